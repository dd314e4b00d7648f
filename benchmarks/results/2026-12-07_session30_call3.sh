#!/usr/bin/env bash
# session 30 call 3: tests/gpu on the tree (B = 028b8f7: the rows kernel), bench_verify 7b/3b/14b B, then A (patch -R of out/p_rows2.patch = 5c3b0bb's gemv_fp16.cu)
export NANOQWEN_COMMIT=${NANOQWEN_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s); t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
build() { timeout 200 python3 -c "from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1; }
F='^ *[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$'
vb() { for m in 7b 3b 14b; do t "$1 bench_verify $m"; timeout 150 python3 benchmarks/bench_verify.py --preset $m --reps ${2:-10} --json "$OUT/verify_${m}_$1.json" 2>&1 | grep -E "^lm_head|decode step" | head -4; done; }
{
. benchmarks/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
t "B tests/gpu"; timeout 330 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -5
vb B 15
t "A: patch -R"; patch -R -p1 -s < out/p_rows2.patch && build
vb A 15
python3 -c "
import json
for m in ('7b','3b','14b'):
    try: a,b=(json.load(open(f'$OUT/verify_{m}_{x}.json')) for x in 'AB')
    except Exception as e: print(m, e); continue
    print(m, 'decode A/B', round(a['decode_graph_ms'],3), round(b['decode_graph_ms'],3))
    print(' '.join(f\"{ra['k']}:{ra['ms']:.3f}/{rb['ms']:.3f}\" for ra,rb in zip(a['rows'],b['rows'])))"
patch -p1 -s < out/p_rows2.patch
t done
} 2>&1 | tee "$OUT/call3.log"
