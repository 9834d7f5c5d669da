#!/usr/bin/env bash
# The checks to run first on a freshly lent GPU after executor changes, in one device call (about 6-8 minutes
# on an H200): the GPU test suite, what the warm-up leaves to serving, graph memory per decode size, the card
# against the shipped profile, and KV block placement against decode time. Logs go to $OUT (or ./gpu_checks).
# Usage on the device: `bash tools/gpu_checks.sh` (sources tools/device_setup.sh itself).
OUT=${OUT:-gpu_checks}
source tools/gpu_steps.sh  # $OUT, the machine's set-up, and run NAME SECONDS COMMAND...
run tests 300 python3 -m pytest -q tests/test_gpu_executor.py tests/test_gpu_kernels.py tests/test_gpu_model.py tests/test_partitions.py
run first_launch 120 python3 bench/first_launch.py
run graph_capture 120 python3 bench/graph_capture.py --sizes 8,40,72,112,132
run card_check 120 python3 bench/card_check.py --count 30
run kv_scatter 120 python3 bench/kv_scatter.py
