#!/usr/bin/env bash
# session 34 call 1: the decode step's folded norms (NANOQWEN_NORM_FOLD). Build; the new and
# the most exposed tests first (test_norm_fold.py, test_kernels.py, the backend's switch and
# teacher-forced tests); then the A/B on one machine, fold on (1) then off (0) per preset,
# `nanoqwen bench --synthetic P -p 512 -n 128 -r 5 --mode graph,eager`, 0.5b and 7b twice (the
# second time off first); then all of tests/gpu. Carry .whl.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "targeted tests"
timeout 150 python3 -m pytest tests/gpu/test_norm_fold.py tests/gpu/test_kernels.py \
  tests/gpu/test_cuda_backend.py -k "norm_fold or Norm or teacher or graph_equals or embed or rmsnorm or core_rejects" \
  -q --tb=short -p no:cacheprovider 2>&1 | tail -25
for m in 0.5b 7b 1.5b 3b; do
  for f in 1 0; do t "bench $m fold $f"; NANOQWEN_NORM_FOLD=$f bj bench_${m}_fold${f} --synthetic $m -p 512 -n 128 -r 5 --mode graph,eager; done
done
for m in 0.5b 7b; do
  for f in 0 1; do t "bench $m fold $f (again)"; NANOQWEN_NORM_FOLD=$f bj bench_${m}_fold${f}_2 --synthetic $m -p 512 -n 128 -r 5 --mode graph,eager; done
done
t "tests/gpu"
timeout 270 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -30
t "done"
} 2>&1 | tee "$OUT/s34c1_$C.log"
tar -C "$R" -czf "$OUT/s34c1_$C.tgz" . && rm -rf "$R"
