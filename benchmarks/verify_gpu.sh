#!/usr/bin/env bash
# The whole GPU verification in one device call, each stage time-boxed so the call ends
# inside its limit: install, build, all of tests/gpu (kernels, GEMVs, attention, backend, app,
# compute-sanitizer), the 7B bench, the per-op step breakdown, and the same bench with
# programmatic dependent launch off (A/B). Logs under $OUT.
# usage (the device copy has no .git, so pass the commit from here; carry .whl for the app
# test's textual wheels):
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD, evaluated here> bash benchmarks/verify_gpu.sh
# MIN_PPS_AB="1 4" adds graph benches at those NANOQWEN_ATTN_MIN_PPS values (with AB=1).
# LAB=1 adds the lab (benchmarks/lab/: the kernel variants that left csrc/): its GEMV harness
# (HARNESS_VARIANTS=REGEX limits it to matching variants), its paged_attention test and
# bench_step's --alt rows; AB=0 skips the PDL-off bench, NCU=1 adds an Nsight Compute pass over
# the four INT4 GEMVs (benchmarks/ncu_gemv.py).
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
if [ "${LAB:-0}" = 1 ]; then
t "lab: gemv harness (variants: ${HARNESS_VARIANTS:-all})"; GEMV_COMMIT=${NANOQWEN_COMMIT:-unknown} timeout 200 python3 benchmarks/lab/gemv_harness.py --out /tmp/gemv ${HARNESS_VARIANTS:+--variants "$HARNESS_VARIANTS"} 2>&1 | tail -34
t "lab: paged_attention test"; timeout 120 python3 -m pytest benchmarks/lab -q --tb=short -p no:cacheprovider 2>&1 | tail -8
fi
t "bench 7b"; timeout 80 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph,eager 2>&1 | tail -12
ALT=; [ "${LAB:-0}" = 1 ] && ALT=--alt  # the lab library is built by then
t "bench_step"; (cd benchmarks && timeout 90 python3 bench_step.py $ALT 2>&1 | tail -60)
if [ "${AB:-1}" = 1 ]; then
t "bench 7b, PDL off"; NANOQWEN_PDL=0 timeout 70 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph 2>&1 | tail -6
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
