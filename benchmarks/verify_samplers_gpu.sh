#!/usr/bin/env bash
# One device call for issue 12 item 3 (samplers at no cost): install, build, a smoke run of the
# sampler's cluster (timed out, so a hang costs a minute, not the call), bench_samplers.py (7B
# synthetic, graph mode: what each setting adds to the decode step), bench_step.py --sampler-only
# (each setting alone, the cluster against one block), `nanoqwen bench --synthetic 7b`,
# then the sampler tests, or all of tests/gpu with FULL=1 (BENCH=0: the tests alone). OLD=1
# then reverses out/sampler_old.patch (carried: `git diff <old> <new> -- csrc`), rebuilds and
# runs bench_samplers.py (and, STEP=1, bench_step --sampler-only) on the old sampler, the same
# machine's A/B. STEP=0 / B7=0 skip bench_step's table / the 7B bench. Logs and JSON under $OUT.
# usage (carry .whl [out]): NANOQWEN_COMMIT=<git rev-parse --short HEAD here> [FULL=1] [BENCH=0] [OLD=1] bash benchmarks/verify_samplers_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 NANOQWEN_COMMIT
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
if [ "${OLD:-0}" = 1 ] && [ ! -s out/sampler_old.patch ]; then  # session 28 lost its A/B to this
  echo "OLD=1 needs out/sampler_old.patch (carry out): nothing run"; exit 2
fi
{
. benchmarks/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t "smoke: the cluster against one block, the path bits"
timeout 120 python3 -m pytest tests/gpu/test_sampler_cluster.py -x -q --tb=short -p no:cacheprovider -s \
  -k "cluster_is_used or any_block_count" 2>&1 | grep -v "^$" | tail -25
SMOKE=$?
if [ "${BENCH:-1}" = 1 ]; then
t "bench_samplers"
timeout 240 python3 benchmarks/bench_samplers.py --json "$OUT/samplers_7b.json" 2>&1 | tail -22
if [ "${STEP:-1}" = 1 ]; then
t "bench_step sampler table"
timeout 150 python3 benchmarks/bench_step.py --sampler-only --json "$OUT/sampler_calls_7b.json" 2>&1 | tail -52
fi
if [ "${B7:-1}" = 1 ]; then
t "bench 7b"
timeout 120 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph,eager --json > "$OUT/bench_7b.json" && tail -c 400 "$OUT/bench_7b.json"; echo
fi
fi
if [ "${FULL:-0}" = 1 ]; then t "tests/gpu"; timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -30
else t "sampler tests"; timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu/test_sampler_cluster.py tests/gpu/test_kernels.py -q --tb=short -p no:cacheprovider -k "sampl or top or cluster or block" 2>&1 | grep -v "^$" | tail -40; fi
if [ "${OLD:-0}" = 1 ]; then
  t "the old sampler: patch -R out/sampler_old.patch, rebuild, bench_samplers"
  patch -R -p1 -s < out/sampler_old.patch && timeout 200 python3 -c "
from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -3 &&
  timeout 240 python3 benchmarks/bench_samplers.py --json "$OUT/samplers_7b_old.json" 2>&1 | tail -22
  [ "${STEP:-1}" = 1 ] && timeout 150 python3 benchmarks/bench_step.py --sampler-only \
    --json "$OUT/sampler_calls_7b_old.json" 2>&1 | tail -52
  patch -p1 -s < out/sampler_old.patch
fi
t "done (smoke rc $SMOKE)"
} 2>&1 | tee "$OUT/verify_samplers_log.txt"
true
