#!/usr/bin/env bash
# Issue K on one GPU: a worker of examples/train_gpt.py (124M, bf16, --deterministic) SIGKILLed at step 40 under
# elastic-run is replaced by its node's warm spare, which restores its tier-0 snapshot; the final digest must
# equal an uninterrupted run's. Prints both digests, the restart event and where the replacement resumed.
#   bench/gpu_spare_exactness.sh OUT_DIR
set -euo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
gpt=(examples/train_gpt.py --layers 12 --heads 12 --d-model 768 --seq-len 1024 --vocab 8192 --global-batch 64
     --max-micro-batch 16 --dtype bf16 --deterministic --steps 60 --ckpt-every 20 --snapshot-every 1 --log-every 10)
run() {  # name, extra env
    local name=$1; shift
    rm -rf "/tmp/exact-$name"
    env "$@" ELASTIC_EVENTS_DIR="/tmp/exact-$name/events" python3 -m elastic.launcher --standalone --nproc-per-node 1 \
        --max-restarts 2 --monitor-interval 0.1 "${gpt[@]}" --ckpt-dir "/tmp/exact-$name/ckpt" \
        > "$out/$name.log" 2>&1
    grep -h '"final_digest"' /tmp/exact-$name/events/*.jsonl | sed 's/.*"digest": "\([0-9a-f]*\)".*/\1/' | sort -u
}
a=$(run uninterrupted X=1)
b=$(run killed ELASTIC_FAULTS='[{"point": "step", "step": 40, "rank": 0}]')
grep -h "\"restart\"\|\"resumed\"\|\"spare_ready\"\|\"spare_started\"\|first_step_after" /tmp/exact-killed/events/*.jsonl | cut -c1-300 || true
echo "uninterrupted=$a"
echo "killed=$b"
[ -n "$a" ] && [ "$a" = "$b" ] && echo "EXACT: digests equal" || echo "MISMATCH"
