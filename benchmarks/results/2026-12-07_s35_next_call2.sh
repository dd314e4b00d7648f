#!/usr/bin/env bash
# Ready for session 36, after 2026-12-07_s35c1_call.sh (carry .whl; any one-GPU kind, the A/B is
# within the call): attempts/gemv-0.5b-down-k8.patch (the 0.5B's down_proj on 8 warps, every
# ring stage copied before griddep_wait; RESULTS.md session 35 says why) against the product,
# end to end. The 0.5B bench (graph, eager) twice each, alternating, bench_step on both, then
# all of tests/gpu on the patched tree (for landing it if it wins; FULL=0 skips them), with 4
# pytest-xdist workers first and serially if that fails.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
build() { timeout 200 python3 -c "
from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1; }
for r in 1 2; do
  t "0.5b product ($r)"; bj "bench_0.5b_product_${r}_$C" --synthetic 0.5b -p 512 -n 128 -r 5 --mode graph,eager
  patch -p1 -s < benchmarks/attempts/gemv-0.5b-down-k8.patch && build
  t "0.5b down K8 ($r)"; bj "bench_0.5b_down-k8_${r}_$C" --synthetic 0.5b -p 512 -n 128 -r 5 --mode graph,eager
  [ $r = 1 ] && { t "bench_step 0.5b (patch)"; timeout 120 python3 benchmarks/bench_step.py --preset 0.5b \
    --json "$R/bench_step_0.5b_down-k8_$C.json" 2>&1 | sed -n 1,16p; }
  patch -R -p1 -s < benchmarks/attempts/gemv-0.5b-down-k8.patch && build
done
t "bench_step 0.5b (product)"
timeout 120 python3 benchmarks/bench_step.py --preset 0.5b --json "$R/bench_step_0.5b_product_$C.json" 2>&1 | sed -n 1,16p
if [ "${FULL:-1}" = 1 ]; then
  patch -p1 -s < benchmarks/attempts/gemv-0.5b-down-k8.patch && build
  # 4 pytest-xdist workers on the one GPU (on the device image; RESULTS.md session 35, ready
  # item 4), timed against session 34's 185 s serially; any failure -> the serial run decides
  t "tests/gpu (patch), 4 workers"
  if ! timeout 200 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 \
       --dist loadfile 2>&1 | tail -15; then
    t "tests/gpu (patch), serially (the 4-worker run failed or timed out)"
    timeout 260 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -15
  fi
  patch -R -p1 -s < benchmarks/attempts/gemv-0.5b-down-k8.patch
fi
t "done"
} 2>&1 | tee "$OUT/next2_$C.log"
tar -C "$R" -czf "$OUT/next2_$C.tgz" . && rm -rf "$R"
