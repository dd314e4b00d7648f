#!/usr/bin/env bash
# session 29 experiment: column GEMVs' x prefetched one stage ahead (P1), + L1 carveout (P2)
export NANOQWEN_COMMIT=${NANOQWEN_COMMIT:-032e149}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
build() { timeout 200 python3 -c "from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -2; }
{
. benchmarks/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t "A: landed"; timeout 150 python3 benchmarks/bench_verify.py --reps 20 --json "$OUT/verify_A.json" 2>&1 | tail -28
t "B: P1 prefetch"; patch -p1 -s < out/p1_prefetch.patch && build
timeout 150 python3 benchmarks/bench_verify.py --reps 20 --json "$OUT/verify_B.json" 2>&1 | tail -28
t "B tests"; timeout 200 python3 -m pytest tests/gpu/test_gemv.py tests/gpu/test_verify.py -q --tb=short -p no:cacheprovider 2>&1 | tail -6
t "C: P1+P2 carveout"; patch -R -p1 -s < out/p1_prefetch.patch && patch -p1 -s < out/p12.patch && build
timeout 150 python3 benchmarks/bench_verify.py --reps 20 --json "$OUT/verify_C.json" 2>&1 | tail -28
patch -R -p1 -s < out/p12.patch
t "A again: landed"; build; timeout 150 python3 benchmarks/bench_verify.py --reps 20 --json "$OUT/verify_A2.json" 2>&1 | tail -28
t done
} 2>&1 | tee "$OUT/exp1.log"
