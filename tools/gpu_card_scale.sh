#!/usr/bin/env bash
# Does a card's launch speed, measured once, carry to other runs on the GPU? (issue 9; about 9 minutes on an
# H200). First `bullet validate --save-scaled` on one run (chunked-2048, sharegpt at 0.6 of its simulated
# capacity) writes the shipped model scaled to this card; then the six validate points (sharegpt and azure-code
# at 0.3 / 0.6 / 0.9) run with that model. Offline on the sixteenth session's saved runs one run's factors put
# 3 of the 5 other chunked points within 5 % (bench/RESULTS.md). Logs and reports go to $OUT (or ./card_scale).
# Usage on the device: `bash tools/gpu_card_scale.sh` (sources tools/device_setup.sh itself).
set -o pipefail
OUT=${OUT:-card_scale}
mkdir -p "$OUT"
source tools/device_setup.sh > "$OUT/setup.log" 2>&1
common=(--policy chunked --max-batched-tokens 2048 --num-requests 150)
bullet validate "${common[@]}" --trace sharegpt --load 0.6 --save-scaled "$OUT/card.json" --out "$OUT/calibrate" \
    > "$OUT/calibrate.log" 2>&1
echo "calibrate: exit $? ($(grep -o 'wrote .*' "$OUT/calibrate.log" | tail -1))"
bullet validate "${common[@]}" --trace sharegpt,azure-code --load 0.3,0.6,0.9 --latency "$OUT/card.json" \
    --out "$OUT/scaled" > "$OUT/scaled.log" 2>&1
echo "scaled: exit $?"
grep -A12 "simulator error per run" "$OUT/scaled.log"
