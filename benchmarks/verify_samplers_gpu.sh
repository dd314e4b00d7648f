#!/usr/bin/env bash
# One device call for issue 12 item 3 (samplers at no cost): install, build, the sampler tests
# (or all of tests/gpu with FULL=1), benchmarks/bench_samplers.py (7B synthetic, graph mode),
# bench_step.py's sampler table. Logs and JSON under $OUT.
# usage (carry .whl): NANOQWEN_COMMIT=<git rev-parse --short HEAD here> bash benchmarks/verify_samplers_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 NANOQWEN_COMMIT
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
{
. benchmarks/device_setup.sh
if [ "${FULL:-0}" = 1 ]; then t "tests/gpu"; timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -30
else t "sampler tests"; timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu/test_sampler_fast.py tests/gpu/test_kernels.py -q --tb=short -p no:cacheprovider -k "sampl or top" -s 2>&1 | grep -v "^$" | tail -40; fi
t "bench_samplers"
timeout 200 python3 benchmarks/bench_samplers.py --json "$OUT/samplers_7b.json" 2>&1 | tail -20
[ "${BENCH:-0}" = 1 ] && { t "bench 7b"; timeout 100 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph,eager --json > "$OUT/bench_7b.json" && tail -c 300 "$OUT/bench_7b.json"; }
t "bench_step sampler table"
timeout 150 python3 benchmarks/bench_step.py 2>&1 | sed -n '/sample_token/,$p' | tail -20
t "done"
} 2>&1 | tee "$OUT/verify_samplers_log.txt"
true
