#!/usr/bin/env bash
# Builds the cluster tier's Go binaries from the Go module proxy into
# $CACHE/bin, one at a time (2 cores: a parallel build only thrashes), and
# logs the wall time and peak RSS of each to $CACHE/bin/build-times.txt. A
# binary already there is kept, so a second run builds nothing. The module
# files (go.mod, go.sum: the pinned versions and their checksums) are
# scripts/cluster.d/modules/NAME, copied into $CACHE/modules/NAME to build.
#
#   scripts/cluster.d/build.sh CACHE [WHAT...]   WHAT: cluster sidecars e2e (default: all)
set -euo pipefail
# One compound command, read whole before it runs (a shared checkout may
# change this file during a run).
{
CACHE=${1:?usage: build.sh CACHE [cluster|sidecars|e2e]...}; shift
[ $# -gt 0 ] || set -- cluster sidecars e2e
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/cluster.d/versions.sh
. "$HERE/versions.sh"
NICE=${LULL_CLUSTER_NICE:-10}
export GOFLAGS=-mod=mod CGO_ENABLED=0 GOTOOLCHAIN=local
B=$CACHE/bin M=$CACHE/modules log=$CACHE/bin/build-times.txt
mkdir -p "$B" "$M"
module() { # module NAME: the pinned module files, fresh in the cache
  mkdir -p "$M/$1"
  cmp -s "$HERE/modules/$1/go.mod" "$M/$1/go.mod" || cp "$HERE/modules/$1/go.mod" "$HERE/modules/$1/go.sum" "$M/$1/"
}
minor=${K8S_VERSION#1.}; minor=${minor%%.*}
vx() { # version ldflags for both version packages, as hack/lib/version.sh sets them
  local p
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    printf -- '-X %s.gitVersion=v%s -X %s.gitMajor=1 -X %s.gitMinor=%s -X %s.gitTreeState=clean -X %s.buildDate=%s ' \
      "$p" "$K8S_VERSION" "$p" "$p" "$minor" "$p" "$p" "1970-01-01T00:00:00Z"
  done
}
one() { # one NAME MODULE PACKAGE LDFLAGS [test]: go build (or go test -c) into $B/NAME
  local name=$1 mod=$2 pkg=$3 ld=$4 kind=${5:-build}
  [ -x "$B/$name" ] && return 0
  module "$mod"
  echo "scripts/cluster: building $name ($pkg)"
  local cmd=(go build -trimpath -ldflags "-s -w $ld" -o "$B/$name.tmp" "$pkg")
  [ "$kind" = test ] && cmd=(go test -c -trimpath -ldflags "-s -w $ld" -o "$B/$name.tmp" "$pkg")
  ( cd "$M/$mod" && /usr/bin/time -f "$name wall=%es user=%Us sys=%Ss maxrss=%MKB" -a -o "$log" \
      nice -n "$NICE" "${cmd[@]}" )
  mv "$B/$name.tmp" "$B/$name"
  tail -1 "$log"
}
for what in "$@"; do
  case $what in
    cluster)
      one etcd etcd go.etcd.io/etcd/server/v3 ""
      one kube-apiserver k8s k8s.io/kubernetes/cmd/kube-apiserver "$(vx)"
      one kube-controller-manager k8s k8s.io/kubernetes/cmd/kube-controller-manager "$(vx)"
      one kube-scheduler k8s k8s.io/kubernetes/cmd/kube-scheduler "$(vx)"
      one kubelet k8s k8s.io/kubernetes/cmd/kubelet "$(vx)"
      # kubectl of the same version, always built: the machine's may be
      # another version or a stand-in
      one kubectl k8s k8s.io/kubernetes/cmd/kubectl "$(vx)" ;;
    sidecars)
      one csi-provisioner sidecars "github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner" ""
      one csi-resizer sidecars "github.com/kubernetes-csi/external-resizer/v2/cmd/csi-resizer" ""
      one csi-snapshotter sidecars "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter" ""
      one snapshot-controller sidecars "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller" "" ;;
    e2e)
      one e2e.test k8s k8s.io/kubernetes/test/e2e "$(vx)" test
      one ginkgo k8s github.com/onsi/ginkgo/v2/ginkgo ""
      one agnhost k8s k8s.io/kubernetes/test/images/agnhost "" ;;
    *) echo "scripts/cluster.d/build.sh: unknown $what" >&2; exit 2 ;;
  esac
done
exit
}
