#!/usr/bin/env bash
# Turn on etcd's authentication with one role for elastic-train (deploy/README.md, "etcd TLS and
# auth"). Run it once per etcd cluster, as the cluster's administrator, with etcdctl's usual
# environment pointing at the cluster with the root client certificate from tls-certs.sh:
#
#   export ETCDCTL_ENDPOINTS=https://127.0.0.1:2379 ETCDCTL_CACERT=certs/ca.crt \
#          ETCDCTL_CERT=certs/root.crt ETCDCTL_KEY=certs/root.key
#   deploy/etcd/enable-auth.sh [PREFIX]
#
# PREFIX is the --rdzv-conf prefix the jobs use (default elastic-train). The user `elastic-train`
# may read and write keys under /PREFIX/ only; it logs in with the client certificate whose CN is
# elastic-train, or, if ELASTIC_TRAIN_PASSWORD is set, with that password (--rdzv-conf
# user=elastic-train,password=...). The root user logs in with the certificate whose CN is root.
set -euo pipefail

prefix=${1:-elastic-train}
prefix=${prefix#/}
prefix=${prefix%/}
ctl=${ETCDCTL:-etcdctl}
: "${ETCDCTL_ENDPOINTS:?set ETCDCTL_ENDPOINTS (and ETCDCTL_CACERT, ETCDCTL_CERT, ETCDCTL_KEY) first}"
# etcdctl reads one word from stdin, and --rdzv-conf splits on ',' and '='.
if [[ ${ELASTIC_TRAIN_PASSWORD:-} =~ [[:space:],=] ]]; then
    echo "enable-auth.sh: ELASTIC_TRAIN_PASSWORD must not contain whitespace, ',' or '='" \
        "(etcdctl and --rdzv-conf cannot carry them)" >&2
    exit 2
fi

"$ctl" endpoint health
"$ctl" user add root --no-password
"$ctl" user grant-role root root
"$ctl" role add elastic-train
"$ctl" role grant-permission elastic-train --prefix=true readwrite "/$prefix/"
if [[ -n ${ELASTIC_TRAIN_PASSWORD:-} ]]; then
    # From stdin, so that the password never shows in a process list.
    "$ctl" user add elastic-train --interactive=false <<<"$ELASTIC_TRAIN_PASSWORD"
else
    "$ctl" user add elastic-train --no-password
fi
"$ctl" user grant-role elastic-train elastic-train
"$ctl" auth enable
