#!/usr/bin/env bash
# Issue 9's re-measurement (bench/RESULTS.md, "Profile protocol for the re-measurement"): the shipped quick
# Llama-3.1-8B profile resumed with solo points on every menu size, each co-run shape also measured alone, 3
# co-run pairs at least on every decode size the co-runs use, and every co-run point in 3 passes (the shipped
# row is the first; the median goes to points.csv, every pass to corun_passes.csv). About 800 s of measuring
# on an H200 (bench/profile_resume_estimate.py), so two device calls of the same script:
#   bash tools/gpu_profile_passes.sh 1   # this card against the shipped profile, then the profile for LIMIT s
#   bash tools/gpu_profile_passes.sh 2   # the profile resumed where call 1 stopped (run it again if it stops)
# The device works on a copy of the tree: after each call, copy $OUT/profile/* into profiles/h200/llama-3.1-8b/
# of the checkout, so the next call resumes from it. `timeout` stopping the profile (exit 124) loses at most the
# point being measured. Then, on the CPU: bullet fit profiles/h200/llama-3.1-8b [--force].
# Another profile or other options: PROF=profiles/h200/qwen3-8b FLAGS="--sizes all --twins --corun-min 3" (the
# model is the folder's name; a resume keeps the passes the profile was measured with, metadata.json).
set -o pipefail
call=${1:?usage: gpu_profile_passes.sh 1|2}
OUT=${OUT:-profile_passes}
PROF=${PROF:-profiles/h200/llama-3.1-8b}
FLAGS=${FLAGS:---sizes all --twins --corun-min 3 --corun-passes 3}
mkdir -p "$OUT/profile"
source tools/device_setup.sh > "$OUT/setup-$call.log" 2>&1
echo "card: $(nvidia-smi --query-gpu=uuid,clocks.sm,power.draw --format=csv,noheader)"
if [ "$call" = 1 ]; then  # is this card as fast as the one that measured the shipped points? (~60 s)
    timeout 90 python3 bench/card_check.py --count 16 --profile "$PROF" > "$OUT/card_check.log" 2>&1
    echo "card_check: exit $?"; tail -6 "$OUT/card_check.log"
fi
start=$(date +%s)
timeout "${LIMIT:-$([ "$call" = 1 ] && echo 480 || echo 560)}" bullet profile --quick $FLAGS \
    --model "$(basename "$PROF")" --out "$PROF" > "$OUT/profile-$call.log" 2>&1
rc=$?
echo "profile: exit $rc in $(( $(date +%s) - start )) s (124: stopped at the limit; run the next call to resume)"
grep -ao "measured [0-9]* points.*" "$OUT/profile-$call.log" | tail -1
cp "$PROF"/points.csv "$PROF"/metadata.json "$OUT/profile/"
for f in corun_passes.csv decode_passes.csv; do [ -f "$PROF/$f" ] && cp "$PROF/$f" "$OUT/profile/"; done
python3 - "$PROF" <<'EOF'
import collections, csv, json, sys
from pathlib import Path
d = Path(sys.argv[1])
rows = list(csv.DictReader((d / "points.csv").open()))
passes = collections.Counter(r["id"] for r in csv.DictReader((d / "corun_passes.csv").open())) \
    if (d / "corun_passes.csv").exists() else {}
meta = json.loads((d / "metadata.json").read_text())
print(f"points.csv {len(rows)} rows of {meta['points']} in the grid; co-run points by passes done:",
      dict(sorted(collections.Counter(passes.values()).items())), "finished" if "finished" in meta else "not finished")
EOF
