#!/usr/bin/env bash
# Issue 10's H200 point in one device call (bench/RESULTS.md, twenty-third session): are bullet's first-run host
# stalls gone (no slow piece, no Triton compile, no generation-2 GC pass over 10 ms), and is bullet's real goodput
# at or above chunked prefill's at each rate, with two runs each to show the card's own spread?
#   bash tools/gpu_policy_check.sh   # ~480 s on an H200: the stall finder on arxiv 12 (~130 s), then arxiv x2 (~340 s)
#   STALLS=0 REPEAT=1 RUNS="sharegpt:10 azure-code:3" bash tools/gpu_policy_check.sh   # ~150 s: the other rows
#   POLICIES="bullet chunked-8192 chunked-2048" ...   # the policies compared (default bullet chunked-8192)
# Logs under $OUT (default policy_check/): stalls.txt, policy_real.txt, pr/runs.json, pr/timeline.csv.
set -o pipefail
OUT=${OUT:-policy_check}
MODEL=profiles/h200/llama-3.1-8b/model.json
mkdir -p "$OUT"
source tools/device_setup.sh > "$OUT/setup.log" 2>&1
echo "card: $(nvidia-smi --query-gpu=uuid,clocks.sm,power.draw --format=csv,noheader)"
if [ "${STALLS:-1}" != 0 ]; then
    timeout 200 python3 bench/host_stalls.py --latency "$MODEL" --runs ${STALL_RUNS:-arxiv:12} --policies bullet chunked-8192 \
        > "$OUT/stalls.txt" 2>&1
    echo "host_stalls: exit $?"; grep -E "host piece|compile|gc generation 2" "$OUT/stalls.txt" | head -20
    grep -A12 "^| trace" "$OUT/stalls.txt"
fi
# shellcheck disable=SC2086  # RUNS is a list of TRACE:RATES words
timeout "${LIMIT:-380}" python3 bench/policy_real.py --latency "$MODEL" --runs ${RUNS:-arxiv:10,12,14} \
    --policies ${POLICIES:-bullet chunked-8192} --num-requests 100 --repeat "${REPEAT:-2}" --out "$OUT/pr" > "$OUT/policy_real.txt" 2>&1
echo "policy_real: exit $?"
sed -n '/bullet goodput (runs)/,$p' "$OUT/policy_real.txt"
