#!/usr/bin/env bash
# session 30 call 1: the lm_head rows kernel for 5-16 columns (out/p_rows.patch, in this tree = B):
# lab sweep, B's GEMV/verify tests, bench_verify B (+ --kernels), then A (patch -R) on one machine
export NANOQWEN_COMMIT=${NANOQWEN_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
build() { timeout 200 python3 -c "from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1; }
F='^ *[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$'
{
. benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
t "lab lm_head_cols"; timeout 240 python3 benchmarks/lab/lm_head_cols.py --json "$OUT/lab_lm_head_cols.json" 2>&1 | tail -24
t "B tests (gemv, verify)"; timeout 240 python3 -m pytest tests/gpu/test_gemv.py tests/gpu/test_verify.py -q --tb=short -p no:cacheprovider 2>&1 | tail -6
t "B bench_verify"; timeout 150 python3 benchmarks/bench_verify.py --reps 20 --json "$OUT/verify_B.json" 2>&1 | grep -Ev "$F" | tail -14
t "B bench_verify --kernels"; timeout 150 python3 benchmarks/bench_verify.py --reps 10 --kernels --json "$OUT/verify_kernels_B.json" 2>&1 | sed -n '/GPU time per eager step/,$p' | head -45
t "A: patch -R"; patch -R -p1 -s < out/p_rows.patch && build
t "A bench_verify"; timeout 150 python3 benchmarks/bench_verify.py --reps 20 --json "$OUT/verify_A.json" 2>&1 | grep -Ev "$F" | tail -14
python3 -c "
import json; a,b=(json.load(open(f'$OUT/verify_{x}.json')) for x in 'AB')
print('decode A/B', round(a['decode_graph_ms'],3), round(b['decode_graph_ms'],3))
for ra,rb in zip(a['rows'],b['rows']): print(ra['k'], round(ra['ms'],3), round(rb['ms'],3), round(rb['ms']/ra['ms'],4), round(rb['ms']/b['decode_graph_ms'],3))"
t "B again: patch"; patch -p1 -s < out/p_rows.patch && build
t done
} 2>&1 | tee "$OUT/call1.log"
