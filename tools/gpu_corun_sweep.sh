#!/usr/bin/env bash
# Issue 9's co-runner sweep (bench/corun_sweep.py): the shipped Llama-3.1-8B profile resumed with --corun-sweep
# (104 co-run points in 2 passes, and their twins; measured 2026-12-03: 240 s in call 1, 318 s in call 2), with NVML
# clocks and power logged. Two device calls of the same script:
#   bash tools/gpu_corun_sweep.sh 1   # the card against the profile (solo and co-run points), the decode-first
#                                     # spread (bench/decode_first_spread.py), then the sweep for LIMIT s
#   bash tools/gpu_corun_sweep.sh 2   # the sweep resumed where call 1 stopped (run it again if it stops)
# The device works on a copy of the tree: after each call, copy $OUT/profile/* into profiles/h200/llama-3.1-8b/
# of the checkout, so the next call resumes from it. Then, on the CPU: bullet fit profiles/h200/llama-3.1-8b.
set -o pipefail
call=${1:?usage: gpu_corun_sweep.sh 1|2}
OUT=${OUT:-corun_sweep}
PROF=profiles/h200/llama-3.1-8b
LOGS="$OUT/logs"
mkdir -p "$OUT/profile" "$LOGS"
source tools/device_setup.sh > "$LOGS/setup-$call.log" 2>&1
echo "card: $(nvidia-smi --query-gpu=uuid,clocks.sm,power.draw,temperature.gpu --format=csv,noheader)"
start=$(date +%s)
if [ "$call" = 1 ]; then
    timeout 150 python3 bench/card_check.py --count 16 --coruns 8 > "$LOGS/card_check.txt" 2>&1
    echo "card_check: exit $? at $(( $(date +%s) - start )) s"; tail -9 "$LOGS/card_check.txt"
    timeout 170 python3 bench/decode_first_spread.py --every 3 --reps 5 --out "$LOGS/decode_first.csv" \
        > "$LOGS/decode_first.txt" 2>&1
    echo "decode_first_spread: exit $? at $(( $(date +%s) - start )) s"; tail -18 "$LOGS/decode_first.txt"
fi
timeout "${LIMIT:-$([ "$call" = 1 ] && echo 240 || echo 540)}" python3 bench/corun_sweep.py --passes 2 \
    --log "$LOGS/sweep$call" > "$LOGS/sweep-$call.txt" 2>&1
echo "sweep: exit $? at $(( $(date +%s) - start )) s (124: stopped at the limit; the next call resumes)"
tail -12 "$LOGS/sweep-$call.txt"
cp "$PROF"/points.csv "$PROF"/metadata.json "$PROF"/corun_passes.csv "$OUT/profile/"
tar czf "$OUT/logs-$call.tgz" -C "$OUT" logs && rm -rf "$LOGS"
