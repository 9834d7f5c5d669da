#!/usr/bin/env bash
# Async scheduling on the GPU (issue 12): the GPU tests of the executor (async cases against the greedy reference,
# through decode and prefill graphs), then the same requests served with and without --async-scheduling through
# `bullet validate` (real vs simulated, and real sync vs real async on one card). About 5 minutes on an H200.
# Usage on the device: `bash tools/gpu_async_check.sh` (sources tools/device_setup.sh itself); output in $OUT.
set -o pipefail
OUT=${OUT:-async_check}
mkdir -p "$OUT"
source tools/device_setup.sh > "$OUT/setup.log" 2>&1
echo "card: $(nvidia-smi --query-gpu=uuid --format=csv,noheader)"
python3 -m pytest -q -m gpu tests/test_gpu_executor.py -k "serve_matches_reference or launch_rules" \
    > "$OUT/tests.log" 2>&1
echo "gpu tests: exit $?"; tail -2 "$OUT/tests.log"
common=(--policy chunked --max-batched-tokens 2048 --trace sharegpt --rate 11.85,17.775 --num-requests 150
        --latency profiles/h200/llama-3.1-8b/model.json --json)
for mode in no-async-scheduling async-scheduling; do
    bullet validate "${common[@]}" --$mode --out "$OUT/$mode" > "$OUT/$mode.json" 2> "$OUT/$mode.log"
    echo "validate --$mode: exit $?"
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
runs = {m: json.load(open(f"{out}/{m}.json")) for m in ("no-async-scheduling", "async-scheduling")}
def rows(rep):
    return rep["runs"] if "runs" in rep else [rep]
print("| mode | rate | real TTFT mean / p90 ms | real TPOT mean / p90 ms | real duration s | sim worst gated error |")
print("|---|---:|---:|---:|---:|---:|")
for m, rep in runs.items():
    for r in rows(rep):
        real = r["real"]
        print(f"| {m} | {r.get('rate', '')} | {real['ttft_ms']['mean']:.1f} / {real['ttft_ms']['p90']:.1f} | "
              f"{real['tpot_ms']['mean']:.2f} / {real['tpot_ms']['p90']:.2f} | {real['duration_s']:.2f} | "
              f"{100 * r['worst_gated_error']:.1f} % |")
PY
tar czf "$OUT/runs.tgz" --exclude='*.tgz' -C "$OUT" . 2>/dev/null
