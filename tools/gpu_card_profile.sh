#!/usr/bin/env bash
# Does a profile measured on the lent card itself bring `bullet validate` within 5 %? (issue 9, the decisive
# test: the shipped profile predicts another H200's compute-bound launches only to within that card's clock.)
# Three stages, one device call each, run back to back so the machine (and its card) stays the same:
#   bash tools/gpu_card_profile.sh profile   # bullet profile --quick + bullet fit into .run/card (~6-7 min)
#   bash tools/gpu_card_profile.sh chunked   # validate chunked-2048 on sharegpt and azure-code (~5 min)
#   bash tools/gpu_card_profile.sh static    # validate static-split-92 on both traces (~6.5 min)
# The rates are the sixteenth session's (0.3 / 0.6 / 0.9 of each policy's simulated capacity on the shipped
# model), so the errors compare point for point with bench/RESULTS.md's table from card GPU-bc07e255.
# Each stage prints the card's UUID: a different one means the machine was released between stages.
set -o pipefail
stage=${1:?usage: gpu_card_profile.sh profile|chunked|static}
OUT=${OUT:-card_profile}
CARD=.run/card
mkdir -p "$OUT" .run
source tools/device_setup.sh > "$OUT/setup-$stage.log" 2>&1
echo "card: $(nvidia-smi --query-gpu=uuid,clocks.sm,power.draw --format=csv,noheader)"
run() {  # validate one policy on one trace at the given rates, with the card's model
    local name=$1 trace=$2 rates=$3; shift 3
    bullet validate --trace "$trace" --rate "$rates" --num-requests 150 --latency "$CARD/model.json" \
        --out "$OUT/$name-$trace" "$@" > "$OUT/$name-$trace.log" 2>&1
    echo "$name $trace: exit $?"
    grep -A14 "simulator error per run" "$OUT/$name-$trace.log"
}
case $stage in
  profile)
    start=$(date +%s)
    bullet profile --quick --out "$CARD" > "$OUT/profile.log" 2>&1
    echo "profile: exit $? in $(( $(date +%s) - start )) s, $(($(wc -l < "$CARD/points.csv") - 1)) points"
    bullet fit "$CARD" --out "$CARD/model.json" --force > "$OUT/fit.log" 2>&1
    echo "fit: exit $?"; tail -22 "$OUT/fit.log"
    tar czf "$OUT/card.tgz" "$CARD" ;;
  chunked)
    run chunked sharegpt 5.925,11.85,17.775 --policy chunked --max-batched-tokens 2048
    run chunked azure-code 1.819,3.637,5.456 --policy chunked --max-batched-tokens 2048 ;;
  static)
    run static sharegpt 4.5,9,13.5 --policy static-split --prefill-sms 92
    run static azure-code 1.162,2.325,3.488 --policy static-split --prefill-sms 92 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
# report.json / launches.csv / logs back in one archive (names with '@' do not come back alone)
tar czf "$OUT/$stage-runs.tgz" --exclude='*.tgz' -C "$OUT" . 2>/dev/null
