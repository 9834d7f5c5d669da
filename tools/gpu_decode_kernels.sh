#!/usr/bin/env bash
# Issue 12's measurements on a lent GPU (H200 times in brackets): the new kernels' GPU tests (3 min, cold),
# the skinny-GEMM sweep against cuBLAS (1.5 min), the paged decode attention's option sweep at 128 x 1024 on
# the whole GPU and a 40-SM decode partition (1 min), the whole-GPU kernel table (1 min), Nsight Compute on
# both kernels (1 min), every GPU test (gputests, 4 min), a 64 x 4096 decode on a 52-SM partition against
# that partition's copy and read rates (part52), and chunked's real TTFT against the roofline's (roofline,
# 2 min); the executor's skinny-GEMM table (table: every decode size x graph bucket x product, into
# $OUT/skinny.json and the shipped profile folder, where the executor loads it) and whole decode steps with and
# without it (skinnystep); a fresh quick profile with the table (profile: into $OUT/profile). Logs to $OUT (or
# ./gpu_decode_kernels). Usage on the device: `bash tools/gpu_decode_kernels.sh [STEP ...]` with steps tests,
# skinny, attn, kernels, ncu, gputests, part52, roofline, table, skinnystep, profile (default: the first five).
OUT=${OUT:-gpu_decode_kernels}
source tools/gpu_steps.sh  # $OUT, the machine's set-up, and run NAME SECONDS COMMAND...
NCU="ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats"
steps=${*:-tests skinny attn kernels ncu}
for step in $steps; do
    case $step in
    tests) run tests 200 python3 -m pytest -q -x tests/test_gpu_kernels.py -k "skinny or decode_attention" ;;
    skinny) run skinny 300 python3 bench/skinny_gemm.py --rows 16,64,128,256 --sms 0,40 --jobs 12 --out "$OUT/skinny.json" ;;
    attn) run attn 150 python3 bench/decode_partition.py --batch 128 --context 1024 --sms 40 --quick --out "$OUT/attn.json" ;;
    kernels) run kernels 200 python3 bench/gpu_kernels.py --quick --out "$OUT/kernels.json" ;;
    gputests) run gputests 330 python3 -m pytest -q tests/test_gpu_executor.py tests/test_gpu_kernels.py \
        tests/test_gpu_model.py tests/test_partitions.py ;;
    part52) run part52 150 python3 bench/decode_partition.py --batch 64 --context 4096 --sms 52 --quick --out "$OUT/part52.json" ;;
    roofline) run roofline 200 bullet validate --policy chunked --latency roofline --trace sharegpt --num-requests 200 \
        --rate 5 --max-error 20 --out "$OUT/roofline" ;;
    table) run table 420 python3 bench/skinny_gemm.py --rows 2,4,8,16,32,48,64,96,128,160,192 \
        --sms 8,16,24,32,40,48,56,64,72,80,88,96,104,112,0 --jobs 14 --out "$OUT/skinny_sweep.json" \
        --shapes 64:64:4,64:64:3,64:128:3,64:128:4,128:64:3,128:64:4,128:128:3,32:256:4 \
        --table "$OUT/skinny.json" --gemm-csv "$OUT/gemm.csv" && cp "$OUT/skinny.json" "$OUT/gemm.csv" \
        profiles/h200/llama-3.1-8b/ ;;
    skinnystep) run skinnystep 300 python3 bench/skinny_step.py --table profiles/h200/llama-3.1-8b/skinny.json \
        --sms 16,32,48,64,132 --batch 16,32,64,128 ;;
    profile) run profile 590 bullet profile --quick --out "$OUT/profile" ;;
    ncu)
        run ncu_attn 120 $NCU -k regex:_decode_split_kernel --launch-skip 2 -c 4 python3 bench/ncu_decode.py attn
        run ncu_gemm 120 $NCU -k regex:'nvjet|gemm|_skinny' --launch-skip 2 -c 4 python3 bench/ncu_decode.py gemm ;;
    esac
done
grep -h '^|' "$OUT/skinny.log" 2>/dev/null | tail -40
