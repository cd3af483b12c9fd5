#!/bin/bash
# pki.sh DIR NODE: a small CA and the certificates and kubeconfigs of a
# loopback-only cluster (everything at 127.0.0.1). Idempotent.
set -euo pipefail
P=${1:?dir}; NODE=${2:?node name}
mkdir -p "$P"; cd "$P"
[ -s ca.key ] || {
  openssl genrsa -out ca.key 2048 2>/dev/null
  openssl req -x509 -new -key ca.key -sha256 -days 3650 -subj "/CN=lull-cluster-ca" -out ca.crt
}
[ -s front-proxy-ca.key ] || {   # for the aggregation layer's request headers
  openssl genrsa -out front-proxy-ca.key 2048 2>/dev/null
  openssl req -x509 -new -key front-proxy-ca.key -sha256 -days 3650 -subj "/CN=lull-cluster-front-proxy-ca" -out front-proxy-ca.crt
}
[ -s sa.key ] || { openssl genrsa -out sa.key 2048 2>/dev/null; openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null; }
cert() { # cert NAME SUBJECT [SAN] : client cert unless SAN is given
  local name=$1 subj=$2 san=${3:-}
  [ -s "$name.crt" ] && return
  openssl genrsa -out "$name.key" 2048 2>/dev/null
  openssl req -new -key "$name.key" -subj "$subj" -out "$name.csr"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    if [ -n "$san" ]; then echo "extendedKeyUsage=serverAuth,clientAuth"; echo "subjectAltName=$san"
    else echo "extendedKeyUsage=clientAuth"; fi
  } > "$name.ext"
  openssl x509 -req -in "$name.csr" -CA "${CA:-ca}.crt" -CAkey "${CA:-ca}.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}
cert apiserver "/CN=kube-apiserver" "IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
cert admin "/O=system:masters/CN=lull-cluster-admin"
cert controller-manager "/CN=system:kube-controller-manager"
cert scheduler "/CN=system:kube-scheduler"
cert kubelet-client "/O=system:nodes/CN=system:node:$NODE"
CA=front-proxy-ca cert front-proxy-client "/CN=front-proxy-client"
cert kubelet-serving "/CN=$NODE" "IP:127.0.0.1,DNS:localhost,DNS:$NODE"
kc() { # kc NAME CERT
  cat > "$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: lull-cluster
  cluster:
    server: https://127.0.0.1:6443
    certificate-authority: $P/ca.crt
users:
- name: $2
  user:
    client-certificate: $P/$2.crt
    client-key: $P/$2.key
contexts:
- name: lull-cluster
  context: {cluster: lull-cluster, user: $2}
current-context: lull-cluster
EOF
}
kc admin admin; kc controller-manager controller-manager; kc scheduler scheduler; kc kubelet kubelet-client
chmod 600 ./*.key
