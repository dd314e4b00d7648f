#!/usr/bin/env bash
# session 30 call 5: tests/gpu on the final tree; bench_verify 7b (sanity against call 3's B); --kernels with PDL off; the refactored lab
export NANOQWEN_COMMIT=${NANOQWEN_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
F='^ *[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$'
{
. benchmarks/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t "tests/gpu"; timeout 200 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -4
t "bench_verify 7b"; timeout 60 python3 benchmarks/bench_verify.py --reps 15 --json "$OUT/verify_7b.json" 2>&1 | grep -Ev "$F" | grep -E "decode step|lm_head|estimate" | head -6
python3 -c "
import json; b=json.load(open('$OUT/verify_7b.json')); d=b['decode_graph_ms']
print('decode', round(d,3), ' '.join(f\"{r['k']}:{r['ms']:.3f}\" for r in b['rows']), 't8/dec', round([r['ms'] for r in b['rows'] if r['k']==8][0]/d,3))"
t "bench_verify --kernels, NANOQWEN_PDL=0"; NANOQWEN_PDL=0 timeout 60 python3 benchmarks/bench_verify.py --reps 5 --kernels --json "$OUT/verify_kernels_7b_pdl0.json" 2>&1 | sed -n '/GPU time per eager step/,$p' | head -32
t "lab lm_head_cols"; timeout 90 python3 benchmarks/lab/lm_head_cols.py --json "$OUT/lab_lm_head_cols3.json" 2>&1 | grep -v "^ptxas" | tail -12
t done
} 2>&1 | tee "$OUT/call5.log"
