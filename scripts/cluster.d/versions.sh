# The cluster tier's pinned versions (sourced by scripts/cluster and
# build.sh). Kubernetes stays on 1.34: this project's machines run cgroup
# v1, which 1.35+ kubelets refuse by default and 1.36 drops with
# containerd 1.x (Debian 12's). The sidecars' versions are the images
# deploy/kubernetes/kustomization.yaml names; the module files under
# scripts/cluster.d/modules pin the same.
K8S_VERSION=1.34.4
ETCD_VERSION=3.6.16
PROVISIONER_VERSION=v6.4.0
RESIZER_VERSION=v2.3.0
SNAPSHOTTER_VERSION=v8.7.0
sidecar_version() { # the pinned version of a sidecar binary
  case $1 in
    csi-provisioner) echo "$PROVISIONER_VERSION" ;;
    csi-resizer) echo "$RESIZER_VERSION" ;;
    csi-snapshotter | snapshot-controller) echo "$SNAPSHOTTER_VERSION" ;;
    *) return 1 ;;
  esac
}
# The test images the external storage e2e suite starts, by the tags
# k8s.io/kubernetes v$K8S_VERSION's test/utils/image/manifest.go gives them.
E2E_AGNHOST_VERSION=2.56
E2E_BUSYBOX_VERSION=1.37.0-1
E2E_NGINX_VERSION=1.14-4
E2E_JESSIE_VERSION=1.7
E2E_PAUSE_VERSION=3.10.1
