#!/bin/bash
# NVMe/TCP over TLS with a PSK from the kernel's initiator: `nvme connect
# --tls`, the kernel handing the handshake to tlshd (ktls-utils) and then
# running the queue pair on kTLS, against `lull serve --nvmf-listen` with
# `--nvmf-psk`. Needs the kernel's CONFIG_NVME_TCP_TLS (6.7+), an nvme-cli
# with `connect --tls` and keyring support (2.5+) and tlshd. Debian 12
# has nvme-cli 2.3 and no ktls-utils, so scripts/kernel-vm builds a
# minimal Debian trixie root (nvme-cli 2.13, ktls-utils 1.0.0) once into
# its cache (KVM_TRIXIE_ROOT) and this file runs tlshd and `nvme` chrooted
# into it (/proc, /sys, /dev bound in); lull, fio, mkfs are the host's.
# Keys: `nvme gen-tls-key --hmac=1` (the interchange format lull reads),
# put in the kernel's `.nvme` keyring by `nvme check-tls-key --insert
# --identity=0` (description `NVMe0R01 HOSTNQN SUBNQN`, the payload the
# TLS PSK libnvme derives), which the kernel looks up on `connect --tls`
# and hands to tlshd. libnvme before 1.16 (trixie's 1.13) derives that PSK
# with a non-RFC 8446 HkdfLabel, lull (as SPDK and libnvme 1.16+) with
# RFC 8446's: the handshake then fails on the binder. So the payload is
# checked against both derivations (computed here in Python) and, when it
# is the old one, replaced by the RFC 8446 key with `keyctl padd` (an
# INFO line says so). kTLS's modules are loaded by hand (see below).
# Checks: a connect with the right key (lull logs tls=true for every
# queue pair), fio with crc32c verify, ext4 round trip, disconnect; a
# wrong key refused (the kernel's and lull's log lines), lull still
# serving and the volume's bytes unchanged; dmesg free of I/O errors;
# SIGTERM exits 0. Without the user space: SKIP with the reason.
. "$KVM_DIR/lib.sh"

VOL_MIB=32          # ext4 (an 8 MiB file) and fio's 16 MiB fit; small, so reading it all is quick under TCG
HOST1=nqn.2014-08.org.nvmexpress:uuid:7a5e0c1e-0000-4000-8000-0000000071a1
HOST2=nqn.2014-08.org.nvmexpress:uuid:7a5e0c1e-0000-4000-8000-0000000071a2
HOSTID1=7a5e0c1e-0000-4000-8000-0000000071a1
HOSTID2=7a5e0c1e-0000-4000-8000-0000000071a2
VOL=tls0; export NQN=$NQN_PREFIX:tls0
TLSHD_WAIT=20       # tlshd up (its start line) after its start, under TCG
REFUSE_WAIT=30      # a refused `nvme connect --tls` returns within this (the kernel's handshake timeout is 10 s)
E_SOCK=$T/e.sock

skip_all() { skip nvmf-tls "$1"; skip nvmf-tls-wrong-psk "$1"; exit 0; }
why=()
kcfg=$(grep -E '^CONFIG_NVME_TCP_TLS=' "$KVM_KCONFIG" 2>/dev/null)
[ "$kcfg" = CONFIG_NVME_TCP_TLS=y ] || why+=("the guest kernel $(uname -r) has no CONFIG_NVME_TCP_TLS (${kcfg:-unset})")
R=${KVM_TRIXIE_ROOT:-}
if [ -z "$R" ]; then
  why+=("no trixie root for nvme-cli with --tls and tlshd (Debian 12's nvme-cli 2.3 has no 'connect --tls', ktls-utils is not packaged for bookworm): ${KVM_TRIXIE_WHY:-unknown}")
elif [ ! -x "$R/usr/sbin/nvme" ] || [ ! -x "$R/usr/sbin/tlshd" ]; then
  why+=("the trixie root $R has no usr/sbin/nvme or usr/sbin/tlshd")
fi
[ ${#why[@]} -gt 0 ] && { r=$(printf '%s; ' "${why[@]}"); skip_all "${r%; }"; }

# kTLS: after its handshake tlshd sets TCP_ULP "tls" on the socket and
# the record keys (AES-128-GCM, the suite lull offers). The kernel's own
# module autoload finds nothing here (its modprobe runs in the initramfs's
# root, not the 9p root the tier binds the module tree into; tlshd then
# says `setsockopt(TLS_ULP): No such file or directory` and `The kernel
# does not support the requested algorithm`), so load them: tls, and
# gcm(aes) from gcm and ghash-generic (aesni_intel where the vCPU has
# AES-NI; optional).
for m in tls gcm ghash_generic; do
  modprobe "$m" 2>> "$TOUT/modprobe.txt" ||
    skip_all "modprobe $m (kTLS, which the kernel's NVMe/TCP TLS runs on) failed: $(tail -n 1 "$TOUT/modprobe.txt")"
done
modprobe aesni_intel 2>> "$TOUT/modprobe.txt"

# ---- the chroot: /proc, /sys, /dev bound in; writes go to the guest's overlay ----
for d in proc sys dev; do mount --bind "/$d" "$R/$d" || skip_all "mount --bind /$d $R/$d failed"; done
mount -t tmpfs tmpfs "$R/run"; mount -t tmpfs tmpfs "$R/tmp"
TLSHD=""
cleanup() {
  [ -n "$TLSHD" ] && kill "$TLSHD" 2>/dev/null
  umount "$R/tmp" "$R/run" "$R/dev" "$R/sys" "$R/proc" 2>/dev/null
}
trap cleanup EXIT
tnvme() { chroot "$R" /usr/sbin/nvme "$@"; }
nvme() { tnvme "$@"; }       # lib.sh's nvme_conn and nvme_disc run trixie's nvme-cli
tnvme connect --help 2>&1 | grep -q -- '--tls' ||
  skip_all "$(tnvme version 2>&1 | head -n1) in the trixie root has no 'nvme connect --tls'"
NVME_VERSION=$(tnvme version 2>&1); LIBNVME_VERSION=$(echo "$NVME_VERSION" | awk '/libnvme/ {print $3; exit}')
info nvmf-tls-tools "$(echo "$NVME_VERSION" | oneline); $(awk '/^Package: /{p=$2} /^Version: /&&(p=="ktls-utils"||p=="keyutils"){printf "%s %s ", p, $2}' "$R/var/lib/dpkg/status")"

# ---- keys ----
# host1's key made by nvme-cli, the other two as docs/NVMF.md makes them
# (one exec each costs seconds under TCG)
K1=$(tnvme gen-tls-key --hmac=1 2>&1) || { fail nvmf-tls "nvme gen-tls-key: $K1"; exit 1; }
read -r K2 K2BAD <<< "$(python3 -c 'import base64,os,zlib
for _ in range(2): k=os.urandom(32); print("NVMeTLSkey-1:01:%s:" % base64.b64encode(k+zlib.crc32(k).to_bytes(4,"little")).decode(), end=" ")')"
printf %s "$K1" > "$T/host1.key"; printf %s "$K2" > "$T/host2.key"; chmod 600 "$T"/host*.key

# ---- tlshd: the kernel's TLS handshake agent, with the .nvme keyring linked ----
printf '[debug]\nloglevel=1\ntls=0\nnl=0\n[authenticate]\nkeyrings=.nvme\n' > "$R/etc/lull-tlshd.conf"
chroot "$R" /usr/sbin/tlshd -s -c /etc/lull-tlshd.conf > "$TOUT/tlshd.log" 2>&1 &
TLSHD=$!
tlshd_up() { grep -q 'Built from ktls-utils' "$TOUT/tlshd.log" && alive "$TLSHD"; }
wait_until "$TLSHD_WAIT" tlshd_up ||
  skip_all "tlshd did not start within ${TLSHD_WAIT}s: $(oneline < "$TOUT/tlshd.log")"
sleep 1   # it asks the kernel for the handshake service after that line
alive "$TLSHD" || skip_all "tlshd exited after its start: $(oneline < "$TOUT/tlshd.log")"
grep -q 'Kernel handshake service is not available' "$TOUT/tlshd.log" &&
  skip_all "tlshd: the kernel handshake service is not available: $(oneline < "$TOUT/tlshd.log")"

# ---- lull: one volume, a key for each of two hosts (so it requires TLS) ----
lull_start PE engine.log 4420 --listen 127.0.0.1:10809 --nvmf-listen 127.0.0.1:4420 --rpc-socket "$E_SOCK" \
  --volume "$VOL:${VOL_MIB}M" --nvmf-psk "$VOL=$HOST1=$T/host1.key" --nvmf-psk "$VOL=$HOST2=$T/host2.key" ||
  { fail nvmf-tls "$LASTERR"; exit 1; }
info nvmf-tls-setup "engine up in ${LULL_UP_SECS}s; tlshd pid $TLSHD"

# psks KEY HOSTNQN: "RFC COMPAT", the TLS PSK (hex) of the interchange
# KEY for (HOSTNQN, NQN), identity version 0, by two derivations. RFC:
# RFC 8446's HkdfLabel (a big-endian length, label and context each with
# a length byte), as lull (docs/NVMF.md), SPDK and libnvme 1.16+ derive
# it. COMPAT: libnvme before 1.16 (trixie's 1.13; 1.16 keeps it as
# "compat"): the length in host order (little endian here), label and
# context without length bytes.
psks() {
  python3 - "$@" <<'PY'
import base64, hashlib, hmac, os, sys
k, host = sys.argv[1:3]
sub = os.environ['NQN']
ikm = base64.b64decode(k.split(':')[2])[:-4]
def hkdf(key, info):          # HKDF-SHA-256, empty salt, 32 bytes
    prk = hmac.new(b'\0' * 32, key, hashlib.sha256).digest()
    return hmac.new(prk, info + b'\x01', hashlib.sha256).digest()
def derive(label):
    ret = hkdf(ikm, label(b'tls13 HostNQN', host.encode()))
    return hkdf(ret, label(b'tls13 nvme-tls-psk', ('NVMe0R01 %s %s' % (host, sub)).encode())).hex()
rfc = lambda l, c: (32).to_bytes(2, 'big') + bytes([len(l)]) + l + bytes([len(c)]) + c
compat = lambda l, c: (32).to_bytes(2, 'little') + l + c
print(derive(rfc), derive(compat))
PY
}
RING=$(awk '$8 == "keyring" && $9 == ".nvme:" {print $1; exit}' /proc/keys)
[ -n "$RING" ] || skip_all "no .nvme keyring in /proc/keys (the kernel's nvme keyring)"
RING=$((16#$RING))
# readkey ID: a key's payload, hex. Reading a key takes possession: .nvme
# is linked into a new session keyring first (as tlshd does), errors in
# keyctl.txt.
readkey() {
  chroot "$R" keyctl session - sh -c "keyctl link $RING @s > /dev/null && keyctl pipe $1 | od -An -tx1 -v" \
    2>> "$TOUT/keyctl.txt" | grep -E '^( [0-9a-f]{2})+$' | tr -d ' \n'
}
# insert KEY HOSTNQN: the TLS PSK for (HOSTNQN, NQN) into .nvme by
# `nvme check-tls-key --insert` (libnvme's derivation); when libnvme's
# derivation is not RFC 8446's (libnvme < 1.16), the key is replaced by the
# RFC 8446 one with keyctl. Sets KEYID, DESC, DERIV (what was found).
insert() {
  local out got rfc compat
  out=$(tnvme check-tls-key --insert --identity=0 --keyring=.nvme --keytype=psk \
    --hostnqn="$2" --subsysnqn="$NQN" --keydata="$1" 2>&1) || { LASTERR="nvme check-tls-key --insert: $(echo "$out" | oneline)"; return 1; }
  echo "$out" >> "$TOUT/keys.txt"
  KEYID=$(echo "$out" | awk '/Inserted TLS key/ {print $NF; exit}')
  [ -n "$KEYID" ] || { LASTERR="nvme check-tls-key --insert printed no key id: $(echo "$out" | oneline)"; return 1; }
  KEYID=$((16#$KEYID))
  DESC=$(chroot "$R" keyctl rdescribe "$KEYID" 2>&1); echo "key $KEYID: $DESC" >> "$TOUT/keyctl.txt"
  DESC=${DESC##*;}
  got=$(readkey "$KEYID")
  read -r rfc compat <<< "$(psks "$1" "$2")"
  if [ "$got" = "$rfc" ]; then DERIV="libnvme's TLS PSK (key $KEYID, '$DESC') is RFC 8446's, as lull's"; return 0; fi
  if [ "$got" != "$compat" ]; then
    LASTERR="libnvme's TLS PSK '${got:0:16}' (key $KEYID, '$DESC') is neither RFC 8446's (${rfc:0:16}..., lull's) nor libnvme's pre-1.16 (${compat:0:16}...); keyctl: $(tail -n 2 "$TOUT/keyctl.txt" | oneline)"; return 1
  fi
  DERIV="libnvme $LIBNVME_VERSION derives the pre-RFC 8446 TLS PSK (${got:0:16}...: HkdfLabel without the label's and context's length bytes, its length little endian; fixed in libnvme 1.16), lull the RFC 8446 one (${rfc:0:16}...): '$DESC' replaced with keyctl padd"
  # the psk key type has no update: the new key replaces the old one in .nvme
  KEYID=$(printf "$(echo "$rfc" | sed 's/../\\x&/g')" | chroot "$R" keyctl padd psk "$DESC" "$RING" 2>> "$TOUT/keyctl.txt") ||
    { LASTERR="keyctl padd psk '$DESC' $RING: $(oneline < "$TOUT/keyctl.txt")"; return 1; }
  echo "key $KEYID: keyctl padd psk '$DESC' (RFC 8446 TLS PSK)" >> "$TOUT/keyctl.txt"
  got=$(readkey "$KEYID")
  [ "$got" = "$rfc" ] || { LASTERR="after keyctl padd key $KEYID holds '${got:0:16}', not ${rfc:0:16}... ($(oneline < "$TOUT/keyctl.txt"))"; return 1; }
}

# vol_sum: the sha256 of the whole volume (direct reads, 1 MiB each)
vol_sum() { dd if="/dev/$DEV" bs=1M iflag=direct status=none | sha256sum | cut -c1-64; }

# ---- the right key ----
kmark tls-ok
ok=1
if insert "$K1" "$HOST1"; then info nvmf-tls-psk "$DERIV"
else fail nvmf-tls-psk "$LASTERR"; exit 1; fi

if nvme_conn "$NQN" --tls --hostnqn="$HOST1" --hostid="$HOSTID1"; then
  q=$(grep -c "queue connected.*hostnqn=$HOST1.*tls=true" "$TOUT/engine.log")
  qf=$(grep -c "queue connected.*hostnqn=$HOST1.*tls=false" "$TOUT/engine.log")
  size=$(( $(cat "/sys/block/$DEV/size") * 512 ))
  if [ "$q" -ge 2 ] && [ "$qf" = 0 ] && [ "$size" = $((VOL_MIB << 20)) ]; then
    pass nvmf-tls-connect "nvme connect --tls -> /dev/$DEV ($CTRL) in ${CONNECT_SECS}s, $size bytes; lull: $q queue pairs tls=true, none plain; kernel: $(ksince tls-ok | grep -m1 -iE "$CTRL.*(tls|creating)" | sed 's/^\[[^]]*\] *//' | oneline)"
  else fail nvmf-tls-connect "/dev/$DEV $size bytes; lull's queue pairs for $HOST1: $q with tls=true, $qf plaintext"; ok=0; fi
  if fio_verify "/dev/$DEV" tls; then pass nvmf-tls-fio "$FIO_SUMMARY"; else fail nvmf-tls-fio "$FIO_SUMMARY"; ok=0; fi
  if fs_roundtrip "/dev/$DEV" ext4 tls; then pass nvmf-tls-ext4 "$FS_DETAIL"; else fail nvmf-tls-ext4 "$LASTERR"; ok=0; fi
  SUM_BEFORE=$(vol_sum)
  if nvme_disc "$NQN"; then pass nvmf-tls-disconnect "nvme disconnect: device and controller gone"
  else fail nvmf-tls-disconnect "$LASTERR"; ok=0; fi
else
  fail nvmf-tls-connect "$LASTERR; kernel: $(ksince tls-ok | grep -iE 'nvme|tls|handshake' | tail -n 3 | oneline); tlshd: $(tail -n 3 "$TOUT/tlshd.log" | oneline); lull: $(grep -iE 'tls|refus' "$TOUT/engine.log" | tail -n 2 | oneline)"
  ok=0
fi
kclean nvmf-tls-dmesg tls-ok
[ "$ok" = 1 ] && pass nvmf-tls "the kernel's NVMe/TCP TLS (tlshd, PSK) against lull: connect, fio verify, ext4, disconnect"

# ---- a wrong key: HOST2's identity with a key lull does not have for it ----
kmark tls-bad
nlog=$(wc -l < "$TOUT/engine.log")
if ! insert "$K2BAD" "$HOST2"; then fail nvmf-tls-wrong-psk "$LASTERR"; exit 1; fi
t0=$(now)
out=$(timeout "$REFUSE_WAIT" chroot "$R" /usr/sbin/nvme connect -t tcp -a 127.0.0.1 -s "$NVME_PORT" -n "$NQN" --tls \
  --hostnqn="$HOST2" --hostid="$HOSTID2" --ctrl-loss-tmo=0 2>&1); rc=$?
el=$(secs "$t0")
klines=$(ksince tls-bad | grep -iE 'nvme|tls|handshake' | grep -v kvm-mark | sed 's/^\[[^]]*\] *//' | head -n 3 | oneline)
llines=$(tail -n +"$((nlog + 1))" "$TOUT/engine.log" | grep -iE 'refus|tls|handshake' | head -n 2 | oneline)
if [ "$rc" = 0 ] || nvme_dev "$NQN" > /dev/null; then
  fail nvmf-tls-wrong-psk "a wrong PSK was let in (nvme connect rc $rc: $(echo "$out" | oneline); device $(nvme_dev "$NQN"))"
  nvme_disc "$NQN"
elif [ "$rc" = 124 ]; then
  fail nvmf-tls-wrong-psk "nvme connect with a wrong PSK did not return within ${REFUSE_WAIT}s; kernel: $klines"
elif ! echo "$llines" | grep -qiE 'binder|TLS handshake failed|TLS refused'; then
  fail nvmf-tls-wrong-psk "refused (rc $rc, ${el}s) but lull's log does not say the handshake failed: ${llines:-nothing}; kernel: $klines"
elif ! echo "$klines" | grep -qi 'TLS handshake'; then
  fail nvmf-tls-wrong-psk "refused (rc $rc, ${el}s) but the kernel's log names no failed TLS handshake: ${klines:-nothing}; lull: $llines"
else
  pass nvmf-tls-wrong-psk "refused in ${el}s: nvme: $(echo "$out" | oneline); kernel: $klines; lull: $llines"
fi
alive "$PE" && listening 4420 || fail nvmf-tls-wrong-psk "lull is not serving after the refusal"

# lull still serves, and the volume is as the right host left it
kmark tls-again
if nvme_conn "$NQN" --tls --hostnqn="$HOST1" --hostid="$HOSTID1"; then
  sum=$(vol_sum)
  if [ -n "${SUM_BEFORE:-}" ] && [ "$sum" = "$SUM_BEFORE" ]; then
    pass nvmf-tls-after-refusal "the right key connects again; the volume's sha256 ${sum:0:16} unchanged by the refused host"
  else fail nvmf-tls-after-refusal "the volume's sha256 $sum, before the refused connect ${SUM_BEFORE:-not taken}"; fi
  nvme_disc "$NQN" || fail nvmf-tls-after-refusal "$LASTERR"
else fail nvmf-tls-after-refusal "the right key after a refusal: $LASTERR"; fi
kclean nvmf-tls-dmesg-after tls-bad

stop "$PE"
if [ "$STOP_RC" = 0 ]; then pass nvmf-tls-sigterm "lull exited 0 on SIGTERM"
else fail nvmf-tls-sigterm "lull exited $STOP_RC on SIGTERM ($STOP_NOTE)"; fi
exit 0
