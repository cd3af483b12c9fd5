#!/bin/bash
# NVMe/TCP over TLS with a PSK from the kernel's initiator (`nvme connect
# --tls`; the kernel hands the handshake to tlshd from ktls-utils), and a
# wrong PSK refused. Needs the kernel's CONFIG_NVME_TCP_TLS (6.7+), an
# nvme-cli with `connect --tls` and keyring support (2.5+) and tlshd.
# Debian 12 has nvme-cli 2.3 and no ktls-utils, and bookworm-backports
# has neither package (checked with apt-cache policy on 2026-12-02): on
# such a host both checks SKIP with the reason. When the user space is
# there, this file FAILs until it drives it (nothing here has run yet).
. "$KVM_DIR/lib.sh"

why=()
kcfg=$(grep -E '^CONFIG_NVME_TCP_TLS=' "$KVM_KCONFIG" 2>/dev/null)
[ "$kcfg" = CONFIG_NVME_TCP_TLS=y ] || why+=("the guest kernel $(uname -r) has no CONFIG_NVME_TCP_TLS (${kcfg:-unset})")
if ! nvme connect --help 2>&1 | grep -q -- '--tls'; then
  why+=("$(nvme version 2>/dev/null | head -n1) has no 'nvme connect --tls' (2.5+ has; Debian 12 ships 2.3 and bookworm-backports none)")
fi
command -v tlshd > /dev/null || why+=("no tlshd (ktls-utils: not packaged for bookworm nor bookworm-backports), which does the kernel's TLS handshake")

if [ ${#why[@]} -gt 0 ]; then
  reason=$(printf '%s; ' "${why[@]}"); reason=${reason%; }
  skip nvmf-tls "$reason"
  skip nvmf-tls-wrong-psk "$reason"
  exit 0
fi
fail nvmf-tls "the kernel, nvme-cli and tlshd support TLS here, but this test does not drive them yet (scripts/kernel-vm.d/tests/40-nvmf-tls.sh)"
exit 1
