#!/usr/bin/env bash
# Session 36 call 2 (after call 1 landed verify_sample; carry .whl): two patches, each A/B on
# the same machine, each with the tests that decide it, then tests/gpu on what wins:
# (1) attempts/verify-sample-one-launch.patch: verify_sample's T draws in one sample_token launch
#     (grid y = rows). bench_verify 7B --sampled before and after; test_verify + the sampler's
#     tests with it;
# (2) attempts/gemv-0.5b-down-k8.patch (session 35): the 0.5B bench, alternating, twice; it stays
#     iff both its graph runs beat both product runs;
# (3) tests/gpu on the tree that (1) and (2) leave.
source benchmarks/device_prelude.sh
END=${END:-585}
left() { echo $(( END - ($(date +%s) - S) )); }
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
build() { timeout 200 python3 -c "
from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1; }
t "bench_verify 7b --sampled (product)"
timeout 120 python3 benchmarks/bench_verify.py --preset 7b --reps 10 --sampled \
  --json "$R/bench_verify_7b_sampled_product_$C.json" 2>&1 | grep -A8 "^sampled rows"
OL=benchmarks/attempts/verify-sample-one-launch.patch
patch -p1 -s < $OL && build
t "bench_verify 7b --sampled (one launch)"
timeout 120 python3 benchmarks/bench_verify.py --preset 7b --reps 10 --sampled \
  --json "$R/bench_verify_7b_sampled_one-launch_$C.json" 2>&1 | grep -A8 "^sampled rows"
t "the one-launch patch's tests"
if timeout 150 python3 -m pytest tests/gpu/test_verify.py tests/gpu/test_sampler_cluster.py \
     tests/gpu/test_kernels.py -q --tb=short -p no:cacheprovider -x 2>&1 | tail -6; then OLW=1; else OLW=0; fi
t "one launch passes: $OLW"
[ $OLW = 1 ] || { patch -R -p1 -s < $OL && build; }
K8=benchmarks/attempts/gemv-0.5b-down-k8.patch
for r in 1 2; do
  t "0.5b product ($r)"; bj "bench_0.5b_product_${r}_$C" --synthetic 0.5b -p 512 -n 128 -r 5 --mode graph,eager
  patch -p1 -s < $K8 && build
  t "0.5b down K8 ($r)"; bj "bench_0.5b_down-k8_${r}_$C" --synthetic 0.5b -p 512 -n 128 -r 5 --mode graph,eager
  [ $r = 1 ] && patch -R -p1 -s < $K8 && build
done
WIN=$(python3 -c "import json, glob
g = lambda f: [r['ms_per_token'] for r in json.load(open(f))['rows'] if r['mode'] == 'graph' and 'ms_per_token' in r][0]
k = [g(f) for f in glob.glob('$R/bench_0.5b_down-k8_*.json')]; p = [g(f) for f in glob.glob('$R/bench_0.5b_product_*.json')]
print(1 if len(k) == 2 and len(p) == 2 and max(k) < min(p) else 0)")
t "K8 wins: $WIN"
[ "$WIN" = 1 ] || { patch -R -p1 -s < $K8 && build; }
t "tests/gpu (one launch $OLW, K8 $WIN), 4 workers"
if ! timeout $(( $(left) - 10 )) python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 \
     --dist loadfile 2>&1 | tail -15; then
  t "tests/gpu serially, $(left) s left"
  timeout $(( $(left) - 5 )) python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -15
fi
t "done"
} 2>&1 | tee "$OUT/call2_$C.log"
tar -C "$R" -czf "$OUT/call2_$C.tgz" .
