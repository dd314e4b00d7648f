#!/usr/bin/env bash
# The whole GPU verification in one device call, each stage time-boxed so the call ends
# inside its limit: install, build, all of tests/gpu (kernels, fused ops, backend, app,
# compute-sanitizer), GEMV harness (all variants), the 7B bench, the per-op step breakdown,
# and the same bench with programmatic dependent launch off (A/B). Logs under $OUT.
# usage (the device copy has no .git, so pass the commit from here; carry .whl for the app
# test's textual wheels):
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD, evaluated here> bash benchmarks/verify_gpu.sh
# MIN_PPS_AB="1 4" adds graph benches at those NANOQWEN_ATTN_MIN_PPS values (with AB=1).
# SKIP_HARNESS=1 skips the GEMV harness (HARNESS_VARIANTS=REGEX limits it to matching variants;
# the launchers are always checked and timed), AB=0 the PDL-off / fused-norm benches, NCU=1 adds an
# Nsight Compute pass over the four INT4 GEMVs (benchmarks/ncu_gemv.py).
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
{
t "install"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
t "build"
timeout 150 python3 -c "
import time; t=time.time()
from nanoqwen.engine.build import load_extension, build_dir
print(load_extension(), build_dir(), f'{time.time()-t:.0f}s')" 2>&1 | tail -30
t "tests/gpu"; timeout ${TEST_TIMEOUT:-200} python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -40
[ "${SKIP_HARNESS:-0}" = 1 ] || { t "gemv harness (variants: ${HARNESS_VARIANTS:-all})"; GEMV_COMMIT=${NANOQWEN_COMMIT:-unknown} timeout 150 python3 benchmarks/gemv_harness.py --out /tmp/gemv ${HARNESS_VARIANTS:+--variants "$HARNESS_VARIANTS"} 2>&1 | tail -34; }
t "bench 7b"; timeout 80 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph,eager 2>&1 | tail -12
t "bench_step"; (cd benchmarks && timeout 60 python3 bench_step.py 2>&1 | tail -60)
if [ "${AB:-1}" = 1 ]; then
t "bench 7b, PDL off"; NANOQWEN_PDL=0 timeout 70 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph 2>&1 | tail -6
t "bench 7b, norms fused"; NANOQWEN_FUSE_NORM=1 timeout 70 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph 2>&1 | tail -6
for m in ${MIN_PPS_AB:-}; do  # e.g. MIN_PPS_AB="1 4": attention pages per split
t "bench 7b, attention min pages per split $m"; NANOQWEN_ATTN_MIN_PPS=$m timeout 70 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph 2>&1 | tail -2
done
fi
if [ "${NCU:-0}" = 1 ]; then  # hardware counters of the four INT4 GEMVs (Firecracker machines)
t "ncu"; timeout 60 ncu --clock-control none --kernel-name regex:gemv_int4 --launch-skip 4 \
  --launch-count 4 --section SpeedOfLight --section Occupancy --section WarpStateStats \
  --section MemoryWorkloadAnalysis python3 benchmarks/ncu_gemv.py > "$OUT/ncu_gemv.txt" 2>&1
grep -E "gemv_int4|DRAM Throughput|Memory Throughput|Achieved Occupancy|Issue Slots|Warp Cycles Per Issued|No Eligible" "$OUT/ncu_gemv.txt" | head -60
fi
t "done"
} 2>&1 | tee "$OUT/verify_log.txt"
cp /tmp/gemv/gemv_log.txt "$OUT/" 2>/dev/null; ls /tmp/gemv/*.json >/dev/null 2>&1 && cp /tmp/gemv/*.json "$OUT/" 2>/dev/null
true
