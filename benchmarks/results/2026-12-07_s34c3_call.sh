#!/usr/bin/env bash
# session 34 call 3: the fold with its loads batched ahead of the parts fold (call 2's bench_step:
# at 7B gemv_int4_norm qkv took 7.59 us against 4.87 + rmsnorm 1.69). Build; test_norm_fold.py
# and the backend's fold test; the A/B fold on/off per preset as call 1; bench_step at 0.5B and
# 7B (fold on, then off); all of tests/gpu. Carry .whl.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "targeted tests"
timeout 100 python3 -m pytest tests/gpu/test_norm_fold.py tests/gpu/test_cuda_backend.py -k "norm_fold or Norm or folded or parts or rmsnorm" \
  -q --tb=short -p no:cacheprovider 2>&1 | tail -5
for m in 0.5b 7b 1.5b 3b; do
  for f in 1 0; do t "bench $m fold $f"; NANOQWEN_NORM_FOLD=$f bj bench_${m}_fold${f} --synthetic $m -p 512 -n 128 -r 5 --mode graph,eager; done
done
for m in 7b 0.5b; do
  for f in 0 1; do t "bench $m fold $f (again)"; NANOQWEN_NORM_FOLD=$f bj bench_${m}_fold${f}_2 --synthetic $m -p 512 -n 128 -r 5 --mode graph,eager; done
done
for m in 0.5b 7b; do
  for f in 1 0; do
    t "bench_step $m fold $f"
    NANOQWEN_NORM_FOLD=$f timeout 120 python3 benchmarks/bench_step.py --preset $m 2>&1 | sed -n '1,18p'
  done
done
t "tests/gpu"
timeout 250 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -20
t "done"
} 2>&1 | tee "$OUT/s34c3_$C.log"
tar -C "$R" -czf "$OUT/s34c3_$C.tgz" . && rm -rf "$R"
