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
if [ -z "$SKIP_TESTS" ]; then  # (SKIP_TESTS=1: the serving comparison alone)
    python3 -m pytest -q -m gpu tests/test_gpu_executor.py -k "serve_matches_reference or launch_rules" \
        > "$OUT/tests.log" 2>&1
    echo "gpu tests: exit $?"; tail -2 "$OUT/tests.log"
fi
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
import csv
def gaps(m, r):  # (launches queued: under 50 us after the one before, gaps under 5 ms summed, ms)
    with open(f"{out}/{m}/{r['trace']}@{r['rate']:g}/launches.csv") as f:
        ls = sorted((float(x["start_s"]), float(x["measured_ms"]) / 1e3) for x in csv.DictReader(f))
    g = [b[0] - (a[0] + a[1]) for a, b in zip(ls, ls[1:])]
    return sum(x < 5e-5 for x in g), 1e3 * sum(x for x in g if 0 <= x < 5e-3), len(ls)
print("| mode | rate | real TTFT mean / p90 ms | real TPOT mean / p90 ms | real duration s | queued / launches | "
      "gaps < 5 ms, sum | sim worst gated error |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for m, rep in runs.items():
    for r in rows(rep):
        real = r["real"]
        q, tot, n = gaps(m, r)
        print(f"| {m} | {r.get('rate', '')} | {real['ttft_ms']['mean']:.1f} / {real['ttft_ms']['p90']:.1f} | "
              f"{real['tpot_ms']['mean']:.2f} / {real['tpot_ms']['p90']:.2f} | {real['duration_s']:.2f} | "
              f"{q} / {n} | {tot:.0f} ms | {100 * r['worst_gated_error']:.1f} % |")
PY
tar czf "$OUT/runs.tgz" --exclude='*.tgz' -C "$OUT" . 2>/dev/null
