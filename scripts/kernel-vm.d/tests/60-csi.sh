#!/bin/bash
# The CSI node plugin on the kernel (issue 42): its nvme-tcp and nbd
# attach methods with the kernel's NVMe/TCP initiator and NBD client,
# against real node daemons in the guest.
#
#   csi-kernel-*         the host-built test binary of crates/csi/tests/kernel.rs
#                        run with --ignored, one check per test: NodeStage,
#                        NodePublish, NodeUnpublish, NodeUnstage, NodeExpand
#                        with nvme-tcp and nbd, block, ext4 and xfs, asserting
#                        the data and the kernel's view (sysfs); failover by
#                        restaging on a second node's plugin and daemon
#   csi-sanity-nvme-tcp  scripts/csi-sanity with LULL_CSI_ATTACH=nvme-tcp
#                        (csi-sanity v5.6.0, access types block and mount)
#   csi-dmesg            no I/O error in the kernel's log of the above
#
# Nothing is built here (the guest has no network, the tree is read-only):
# the test binary is the newest target/ci/deps/kernel-* (built by
# `cargo test --profile ci -p lull-csi --no-run`, which scripts/test's
# cargo test does) unless LULL_CSI_KERNEL_TEST names one, and csi-sanity
# is the one scripts/csi-sanity built on the host
# (target/csi-sanity-v5.6.0). Missing, each is a FAIL saying so.
. "$KVM_DIR/lib.sh"

target=${CARGO_TARGET_DIR:-$KVM_REPO/target}
sanity=$target/csi-sanity-v5.6.0/csi-sanity
# The tests the binary holds: each is a check, and one not reported (not
# run, filtered out) is a FAIL, so the file never passes vacuously.
TESTS=(nvme_tcp_stages_publishes_and_grows_on_the_kernel
  nbd_stages_publishes_and_grows_at_the_next_stage_on_the_kernel
  nvme_tcp_fails_over_by_restaging_on_another_node)
# The newest test binary named kernel-* that holds them (another crate's
# `kernel` test would be named so too).
test_bin=${LULL_CSI_KERNEL_TEST:-}
if [ -z "$test_bin" ]; then
  for b in $(ls -t "$target"/ci/deps/kernel-* 2>/dev/null | grep -v '\.d$'); do
    if [ -x "$b" ] && "$b" --list --ignored 2>/dev/null | grep -q "^${TESTS[0]}: test"; then test_bin=$b; break; fi
  done
fi

kmark csi
# ---- the plugin's calls on the kernel's devices ----
t0=$(now)
if [ -z "$test_bin" ] || [ ! -x "$test_bin" ]; then
  fail csi-kernel "no test binary of crates/csi/tests/kernel.rs under $target/ci/deps (build it on the host: cargo test --profile ci -p lull-csi --no-run)"
else
  info csi-kernel "$test_bin (built $(date -r "$test_bin" +%FT%T)), lull $LULL"
  # One test at a time (they share the kernel's nbd devices and its log),
  # each its own run: its verdict is its exit and its one `1 passed`.
  for t in "${TESTS[@]}"; do
    t1=$(now)
    LULL_BIN=$LULL "$test_bin" --ignored --exact --nocapture "$t" > "$TOUT/kernel-$t.txt" 2>&1
    rc=$?
    if [ "$rc" = 0 ] && grep -qE '^test result: ok\. 1 passed' "$TOUT/kernel-$t.txt"; then
      pass "csi-kernel-$t" "$(grep -E '^PASS |^B \(' "$TOUT/kernel-$t.txt" | oneline) in $(secs "$t1")s"
    else
      fail "csi-kernel-$t" "exit $rc: $(grep -m1 -A3 'panicked' "$TOUT/kernel-$t.txt" | oneline) ($TOUT/kernel-$t.txt)"
    fi
  done
  info csi-kernel "$(secs "$t0")s"
fi

# ---- csi-sanity with the kernel's NVMe/TCP initiator ----
t0=$(now)
if [ ! -x "$sanity" ]; then
  fail csi-sanity-nvme-tcp "csi-sanity is not built at $sanity (run scripts/csi-sanity on the host once: it builds it with Go)"
else
  LULL_CSI_ATTACH=nvme-tcp LULL_BIN=$LULL "$KVM_REPO/scripts/csi-sanity" > "$TOUT/csi-sanity-nvme-tcp.txt" 2>&1
  rc=$?
  counts=$(grep -E '^[0-9]+ passed, [0-9]+ failed, [0-9]+ skipped$' "$TOUT/csi-sanity-nvme-tcp.txt" | tail -n1)
  passed=$(sed -nE 's/^([0-9]+) passed.*/\1/p' <<<"$counts")
  if [ "$rc" = 0 ] && [ "${passed:-0}" -gt 0 ]; then
    pass csi-sanity-nvme-tcp "$counts (block and mount) in $(secs "$t0")s"
  else
    fail csi-sanity-nvme-tcp "exit $rc, ${counts:-no counts}: $(grep -m3 -E '\[FAIL\]' "$TOUT/csi-sanity-nvme-tcp.txt" | oneline)"
  fi
fi

# ---- the kernel's log ----
# A controller reconnecting to the daemon the failover test killed is not
# an I/O error ("failed to connect socket", "Failed reconnect attempt").
kclean csi-dmesg csi
