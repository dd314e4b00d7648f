#!/usr/bin/env bash
# One device call: install, build once, GPU tests, benchmarks; logs under $OUT, table last.
# usage: bash benchmarks/run_gpu.sh [quick]   (quick: no sanitizer, no per-kernel benches)
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] $*"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.txt" 2>&1 || { t "pip failed"; tail "$OUT/pip.txt"; }
t "build"
timeout 300 python3 -c "
import time; t=time.time()
from nanoqwen.engine.build import load_extension, build_dir
print(load_extension(), build_dir(), f'{time.time()-t:.0f}s')" 2>&1 | tee "$OUT/build.txt" | tail -30
t "kernel tests"
timeout 80 python3 -m pytest tests/gpu/test_kernels.py -q -x --tb=short -p no:cacheprovider 2>&1 | tee "$OUT/test_kernels.txt" | tail -15
t "bench"
timeout 90 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph,eager 2>&1 | tee "$OUT/bench.txt" | tail -12
t "backend tests"
timeout 120 python3 -m pytest tests/gpu/test_cuda_backend.py -q -s --tb=short -p no:cacheprovider 2>&1 | tee "$OUT/test_backend.txt" | grep -E "rel err|passed|failed|Error|error|assert|^E " | tail -30
t "bench_step"
(cd benchmarks && timeout 90 python3 bench_step.py 2>&1 | tee "$OUT/bench_step.txt" | tail -22)
if [ "$1" != quick ]; then
  t "bench_attention"
  (cd benchmarks && timeout 60 python3 bench_attention.py 2>&1 | tee "$OUT/bench_attention.txt" | tail -10)
  t "sanitizer"
  timeout 200 python3 -m pytest tests/gpu/test_sanitizer.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/test_sanitizer.txt" | grep -E "SUMMARY|passed|failed|skipped|err" | tail -12
fi
t "done"
