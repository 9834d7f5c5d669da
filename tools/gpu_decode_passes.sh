#!/usr/bin/env bash
# Issue 9: the shipped H200 profiles' solo decode points measured in a second pass (`bullet profile --decode-passes
# 2`, in the reverse order of the first), after a check of the card against the Llama-3.1-8B profile. One device
# call: `bash tools/gpu_decode_passes.sh` (sources tools/gpu_steps.sh). The device works on a copy of the tree:
# afterwards copy $OUT/<model>/* into profiles/h200/<model>/ of the checkout (a rerun resumes where a call
# stopped), then on the CPU: bullet fit profiles/h200/<model> [--force].
OUT=${OUT:-decode_passes}
source tools/gpu_steps.sh  # $OUT, the machine's set-up, and run NAME SECONDS COMMAND...
echo "card: $(nvidia-smi --query-gpu=uuid,clocks.sm,power.draw,temperature.gpu --format=csv,noheader)"
run card_check 150 python3 bench/card_check.py --count 16
tail -9 "$OUT/card_check.log"
for model in llama-3.1-8b qwen3-8b; do
    run "passes-$model" "${LIMIT:-300}" bullet profile --model "$model" --out "profiles/h200/$model" --decode-passes 2
    tail -2 "$OUT/passes-$model.log"
    mkdir -p "$OUT/$model"
    cp profiles/h200/$model/points.csv profiles/h200/$model/metadata.json profiles/h200/$model/decode_passes.csv \
        "$OUT/$model/" 2>/dev/null
done
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)  # (at most 8 files come back)
