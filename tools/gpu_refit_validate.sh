#!/usr/bin/env bash
# Issue 9's closing measurement: finish the shipped Llama-3.1-8B profile's re-measurement, refit it, and check
# `bullet validate` on the refit model (mean and p90 TTFT and TPOT within 5 % of the real run, chunked and
# static-split, sharegpt and azure-code at 0.3 / 0.6 / 0.9 of each policy's simulated capacity). Two device calls:
#   bash tools/gpu_refit_validate.sh chunked  # resume the profile to its end (~250 s), fit, validate chunked (~270 s)
#   bash tools/gpu_refit_validate.sh static   # validate static-split-92 on the model in the tree (~360 s)
# After the first call, copy $OUT/profile/* (points.csv, corun_passes.csv, metadata.json, model.json) into
# profiles/h200/llama-3.1-8b/ of the checkout, so that the second call validates the refit model. Logs under $OUT
# (default refit_validate/): profile.log, fit.log, validate-POLICY.log (the tables) and each run's
# report.json, launches.csv and cdf.png (in $OUT/chunked.tgz, $OUT/static.tgz: the device's transfer refuses the
# folders' '@' names).
set -o pipefail
stage=${1:?usage: gpu_refit_validate.sh chunked|static}
OUT=${OUT:-refit_validate}
PROF=profiles/h200/llama-3.1-8b
mkdir -p "$OUT/profile"
source tools/device_setup.sh > "$OUT/setup-$stage.log" 2>&1
echo "card: $(nvidia-smi --query-gpu=uuid,clocks.sm,power.draw --format=csv,noheader)"
common=(--trace sharegpt,azure-code --load 0.3,0.6,0.9 --num-requests 150 --latency "$PROF/model.json")
case $stage in
  chunked)
    start=$(date +%s)
    timeout "${LIMIT:-300}" bullet profile --quick --sizes all --twins --corun-min 3 --corun-passes 3 --out "$PROF" \
        > "$OUT/profile.log" 2>&1
    echo "profile: exit $? in $(( $(date +%s) - start )) s (124: stopped at the limit; run this stage again)"
    cp "$PROF"/points.csv "$PROF"/corun_passes.csv "$PROF"/metadata.json "$OUT/profile/"
    if ! grep -q '"finished"' "$PROF/metadata.json"; then echo "profile not finished: no fit, no validate"; exit 1; fi
    bullet fit "$PROF" --force > "$OUT/fit.log" 2>&1  # writes $PROF/model.json: validate below uses it
    echo "fit: exit $? (1: over a threshold, written because forced)"; cat "$OUT/fit.log"
    cp "$PROF/model.json" "$OUT/profile/"
    bullet validate --policy chunked --max-batched-tokens 2048 "${common[@]}" --out "$OUT/chunked" \
        > "$OUT/validate-chunked.log" 2>&1
    echo "validate chunked: exit $? (1: a figure over --max-error)"; tail -30 "$OUT/validate-chunked.log"
    tar czf "$OUT/chunked.tgz" -C "$OUT" chunked && rm -rf "$OUT/chunked" ;;
  static)
    bullet validate --policy static-split --prefill-sms 92 "${common[@]}" --out "$OUT/static" \
        > "$OUT/validate-static.log" 2>&1
    echo "validate static-split: exit $? (1: a figure over --max-error)"; tail -30 "$OUT/validate-static.log"
    tar czf "$OUT/static.tgz" -C "$OUT" static && rm -rf "$OUT/static" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
