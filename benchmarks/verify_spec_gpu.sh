#!/usr/bin/env bash
# The verify step and speculation on the GPU in one device call (issue 13): install, build, the
# verify tests first (tests/gpu/test_verify.py), then (FULL=1) all of tests/gpu; t(k) at 7B
# shapes (bench_verify.py) with the acceptance bench_spec.py measures on the CUDA engine with
# the bundled model; (SPECBENCH=1) `nanoqwen bench --spec` ngram and draft (the bundled model as
# its own draft) on the bundled model; (BENCH=1) the 7B decode bench, which must not move; (DEPTH=1) the 7B bench
# after 8192 cached tokens (nanoqwen bench -d); (LABS=1) the lab runs session 17 could not make:
# the prefill GEMM's block shapes (lab/gemm_int4_shapes.py), the lm_head loads probe (lab/lm_head_tc.py) and
# the INT8-activation decode GEMV (lab/gemv_int8x.py).
# Logs under $OUT.
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD> FULL=1 BENCH=1 bash benchmarks/verify_spec_gpu.sh
#   NANOQWEN_COMMIT=<...> FULL=1 SPEC=0 LABS=1 BENCH=1 bash benchmarks/verify_spec_gpu.sh
# (carry .whl: the app tests' textual wheels)
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
C=${NANOQWEN_COMMIT:-unknown}
{
source benchmarks/device_setup.sh
if [ "${FULL:-0}" != 1 ]; then  # (FULL runs them with the rest)
t "tests/gpu/test_verify.py"; timeout 200 python3 -m pytest tests/gpu/test_verify.py -q -x --tb=short -p no:cacheprovider 2>&1 | tail -30
else
t "tests/gpu"; timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -30
fi
if [ "${SPEC:-1}" = 1 ]; then  # SPEC=0: tests only
t "bench_spec (cuda, bundled model)"; timeout 200 python3 benchmarks/bench_spec.py --backend cuda --reps ${SPEC_REPS:-3} --json "$OUT/bench_spec_cuda_$C.json" 2>&1 | tail -20
t "bench_verify 7b"; (cd benchmarks && timeout 150 python3 bench_verify.py --preset 7b --acceptance "$OUT/bench_spec_cuda_$C.json" --json "$OUT/bench_verify_7b_$C.json" 2>&1 | tail -30)
fi
if [ "${SPECBENCH:-0}" = 1 ]; then  # nanoqwen bench --spec on the bundled model (both drafters)
t "bench --spec ngram"; timeout 200 nanoqwen bench --backend cuda --spec ngram -n 200 -r ${SPECBENCH_REPS:-3} --json > "$OUT/bench_spec_ngram_cuda_$C.json" && python3 benchmarks/spec_rows.py "$OUT/bench_spec_ngram_cuda_$C.json"
t "bench --spec draft (itself)"; timeout 200 nanoqwen bench --backend cuda --spec draft --draft assets/tiny/tiny.nanoqwen -n 200 -r ${SPECBENCH_REPS:-3} --json > "$OUT/bench_spec_draft_cuda_$C.json" && python3 benchmarks/spec_rows.py "$OUT/bench_spec_draft_cuda_$C.json"
fi
if [ "${BENCH:-0}" = 1 ]; then
t "bench 7b"; timeout 100 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph,eager --json > "$OUT/bench_7b_$C.json" && tail -c 400 "$OUT/bench_7b_$C.json"; echo
fi
if [ "${DEPTH:-0}" = 1 ]; then  # issue 14's long-context rows: after 8192 cached tokens
t "bench 7b -d 8192"; timeout 120 nanoqwen bench --synthetic 7b -d 8192 -p 512 -n 128 -r 3 --mode graph --json > "$OUT/bench_7b_d8192_$C.json" && tail -c 400 "$OUT/bench_7b_d8192_$C.json"; echo
fi
if [ "${LABS:-0}" = 1 ]; then
t "lab gemm_int4_shapes"; timeout 330 python3 benchmarks/lab/gemm_int4_shapes.py --json "$OUT/lab_gemm_int4_shapes_$C.json" 2>&1 | grep -v "^proj"
t "lab lm_head_tc (lm_head_read)"; timeout 150 python3 benchmarks/lab/lm_head_tc.py --json "$OUT/lab_lm_head_tc_$C.json" 2>&1 | tail -14
t "lab gemv_int8x (issue 12 item 4)"; timeout 200 python3 benchmarks/lab/gemv_int8x.py --json "$OUT/lab_gemv_int8x_$C.json" 2>&1 | tail -10
fi
t "done"
} 2>&1 | tee "$OUT/verify_spec_$C.log"
