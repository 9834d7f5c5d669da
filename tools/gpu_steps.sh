# Sourced by the device-call scripts (tools/gpu_checks.sh, tools/gpu_decode_kernels.sh) after they set OUT: makes
# $OUT, sets the machine up (tools/device_setup.sh, its log in $OUT/setup.log) and defines
# `run NAME SECONDS COMMAND...`, which runs one step under a timeout, its output in $OUT/NAME.log, and prints
# the step, its exit code and its last line.
set -o pipefail
mkdir -p "$OUT"
source tools/device_setup.sh > "$OUT/setup.log" 2>&1
run() {  # name, timeout seconds, command...
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "   exit $? ($(tail -1 "$OUT/$name.log"))"
}
