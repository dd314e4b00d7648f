#!/usr/bin/env bash
# Session 36 call 1 (any one-GPU kind; carry .whl). The device being scarce (session 35: none in
# 18 tries), the two ready calls of session 35 folded into one, what lands first:
# (1) issue 12's table on all six presets (graph, context 512);
# (2) attempts/gemv-0.5b-down-k8.patch A/B at 0.5B (graph+eager), alternating, twice, bench_step
#     on both; the patch stays applied iff both its graph runs beat both product runs;
# (3) attempts/stepargs-norm-parts.patch applied; tests/gpu on that tree (4 xdist workers, then
#     serially if that fails), so the tree the log names can land;
# (4) as far as time allows: the GEMV family lab, attention's split sizing at 0.5B shapes.
source benchmarks/device_prelude.sh
END=${END:-585}
left() { echo $(( END - ($(date +%s) - S) )); }
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
build() { timeout 200 python3 -c "
from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1; }
for m in 0.5b 1.5b 3b 7b 14b 32b; do
  t "bench $m"
  bj "bench_${m}_p512_n128_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph
done
K8=benchmarks/attempts/gemv-0.5b-down-k8.patch
for r in 1 2; do
  t "0.5b product ($r)"; bj "bench_0.5b_product_${r}_$C" --synthetic 0.5b -p 512 -n 128 -r 5 --mode graph,eager
  [ $r = 2 ] && { t "bench_step 0.5b (product)"; timeout 90 python3 benchmarks/bench_step.py --preset 0.5b \
    --json "$R/bench_step_0.5b_product_$C.json" 2>&1 | sed -n 1,16p; }
  patch -p1 -s < $K8 && build
  t "0.5b down K8 ($r)"; bj "bench_0.5b_down-k8_${r}_$C" --synthetic 0.5b -p 512 -n 128 -r 5 --mode graph,eager
  [ $r = 1 ] && { t "bench_step 0.5b (K8)"; timeout 90 python3 benchmarks/bench_step.py --preset 0.5b \
    --json "$R/bench_step_0.5b_down-k8_$C.json" 2>&1 | sed -n 1,16p; }
  [ $r = 1 ] && patch -R -p1 -s < $K8 && build
done
# the K8 patch is applied now; it stays iff both of its graph runs beat both product runs
WIN=$(python3 -c "import json, glob
g = lambda f: [r['ms_per_token'] for r in json.load(open(f))['rows'] if r['mode'] == 'graph' and 'ms_per_token' in r][0]
k = [g(f) for f in glob.glob('$R/bench_0.5b_down-k8_*.json')]; p = [g(f) for f in glob.glob('$R/bench_0.5b_product_*.json')]
print(1 if len(k) == 2 and len(p) == 2 and max(k) < min(p) else 0)")
t "K8 wins: $WIN"
[ "$WIN" = 1 ] || patch -R -p1 -s < $K8
patch -p1 -s < benchmarks/attempts/stepargs-norm-parts.patch && build
t "tests/gpu (K8 $WIN, stepargs), 4 workers"
if ! timeout $(( $(left) - 20 )) python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 \
     --dist loadfile 2>&1 | tail -15; then
  t "tests/gpu serially (the 4-worker run failed or timed out), $(left) s left"
  timeout $(( $(left) - 5 )) python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -x 2>&1 | tail -15
fi
if [ $(left) -gt 60 ]; then
  t "bench_attention, 0.5B shapes"
  timeout $(( $(left) - 5 )) python3 benchmarks/bench_attention.py --heads 14 --kv-heads 2 --head-dim 64 --layers 24 \
    --contexts 512,2048 --sweep 66:1:1,66:2:1,66:4:1,66:8:1,66:16:1,66:32:1 \
    --json "$R/attn_0.5b_pps.json" 2>&1 | tail -16
fi
if [ $(left) -gt 60 ]; then
  t "lab/gemv_int4_family.py"
  timeout $(( $(left) - 5 )) python3 benchmarks/lab/gemv_int4_family.py --json "$R/gemv_int4_family.json" 2>&1 | tail -30
fi
t "done"
} 2>&1 | tee "$OUT/call1_$C.log"
tar -C "$R" -czf "$OUT/call1_$C.tgz" .
