#!/usr/bin/env bash
# Ready for session 37 (carry .whl; any one-GPU kind, the A/B is within the call; an H200 adds
# issue 12's table): attempts/gemv-family-rows.patch (kInt4Table's rows for the other presets,
# from lab/gemv_int4_family.py, session 36) against the product end to end: every preset but the
# 7B (its rows do not change: the control) product, patched, product again; then the tests that
# decide the patch's GEMVs and, if time is left, all of tests/gpu on the patched tree.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
P=benchmarks/attempts/gemv-family-rows.patch
round() {  # round NAME PRESETS...
  local name=$1; shift
  for m in "$@"; do t "bench $m ($name)"; bj "bench_${m}_${name}_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
}
round product_1 0.5b 1.5b 3b 7b 14b 32b
patch -p1 -s < $P && build
round rows 0.5b 1.5b 3b 7b 14b 32b
patch -R -p1 -s < $P && build
round product_2 0.5b 1.5b 3b 14b 32b
patch -p1 -s < $P && build
t "the GEMV and verify tests with the rows"
timeout 200 python3 -m pytest tests/gpu/test_gemv.py tests/gpu/test_verify.py tests/gpu/test_norm_fold.py \
  -q --tb=short -p no:cacheprovider -n 4 --dist loadfile 2>&1 | tail -5
if [ $(left) -gt 200 ]; then
  t "tests/gpu with the rows, 4 workers"
  timeout $(( $(left) - 5 )) python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 \
    --dist loadfile 2>&1 | tail -8
fi
t "done"
} 2>&1 | tee "$OUT/next_$C.log"
tar -C "$R" -czf "$OUT/next_$C.tgz" .
