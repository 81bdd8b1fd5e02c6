#!/usr/bin/env bash
# Make the certificates for an etcd cluster with TLS and client-certificate auth
# (deploy/README.md, "etcd TLS and auth"). Needs only openssl.
#
#   deploy/etcd/tls-certs.sh OUT_DIR [NAME...]
#
# NAME: DNS names or IP addresses the etcd members are reached by (the server certificate's
# subjectAltNames). Default: the names of deploy/k8s/base/etcd.yaml in namespace $NAMESPACE
# (default elastic-train), plus localhost and 127.0.0.1.
#
# Writes, into OUT_DIR:
#   ca.crt, ca.key          the CA (keep ca.key offline once done)
#   server.crt, server.key  every member's serving and peer certificate
#   root.crt, root.key      client certificate of etcd's `root` user (administration, etcdctl)
#   client.crt, client.key  client certificate of the `elastic-train` user (the trainers)
# With --client-cert-auth and auth enabled, etcd takes a client's user name from its
# certificate's CN, so the trainers need no password.
set -euo pipefail

(($# >= 1)) || {
    echo "usage: tls-certs.sh OUT_DIR [NAME...]" >&2
    exit 2
}
out=$1
shift
ns=${NAMESPACE:-elastic-train}
if (($# == 0)); then
    set -- "etcd-client" "etcd-client.$ns" "etcd-client.$ns.svc" "*.etcd.$ns.svc" "*.etcd.$ns.svc.cluster.local" \
        "etcd.$ns.svc" localhost 127.0.0.1
fi
days=${DAYS:-825}

sans=()
for name in "$@"; do
    if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then
        sans+=("IP:$name")
    else
        sans+=("DNS:$name")
    fi
done
san_list=$(
    IFS=,
    echo "${sans[*]}"
)

mkdir -p "$out"
cd "$out"
umask 077

new_key() {
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
}

# sign NAME CN EXTENSIONS: NAME.key and NAME.crt, signed by the CA.
sign() {
    local name=$1 cn=$2 ext=$3
    new_key "$name.key"
    openssl req -new -key "$name.key" -subj "/CN=$cn" -out "$name.csr"
    printf '%s\n' "$ext" >"$name.ext"
    openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" -sha256 \
        -extfile "$name.ext" -out "$name.crt" 2>/dev/null
    rm -f "$name.csr" "$name.ext"
}

if [[ ! -f ca.key ]]; then
    new_key ca.key
    openssl req -x509 -new -key ca.key -subj "/CN=elastic-train etcd CA" -days 3650 -sha256 \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" -out ca.crt
fi
# Members use one certificate both to serve clients and to talk to each other (peer TLS).
sign server etcd "subjectAltName=$san_list
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth,clientAuth"
for user in root:root client:elastic-train; do
    sign "${user%%:*}" "${user#*:}" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
done
chmod 644 ./*.crt
echo "tls-certs.sh: wrote the CA, server, root and client certificates to $PWD (server names: $san_list)" >&2
