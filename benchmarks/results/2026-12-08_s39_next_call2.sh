#!/usr/bin/env bash
# Ready for session 40 (export NANOQWEN_COMMIT; carry .whl; any one-GPU kind; ~6 min), after
# 2026-12-08_s39_next_call.sh: the verify step's norms folded into its column GEMVs
# (attempts/verify-norm-fold.patch, which applies after attempts/verify-row-tiles.patch) against
# the row tiles alone, on one machine: B = row tiles, C = B + the fold. C's bits first: the fold's
# op tests, the verify rows against decode steps (7B shapes too), fold on against off.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
patch -p1 -s < benchmarks/attempts/verify-row-tiles.patch && t "B: build" && build
t "B: bench_verify 7b"; vb B
patch -p1 -s < benchmarks/attempts/verify-norm-fold.patch && t "C: build" && build
t "C: tests"
timeout 300 python3 -m pytest tests/gpu/test_norm_fold.py tests/gpu/test_verify.py \
  "tests/gpu/test_cuda_backend.py::test_norm_fold_switch_changes_no_bit" -q --tb=short \
  -p no:cacheprovider -n 4 2>&1 | tail -4
t "C: bench_verify 7b"; vb C
[ $(left) -gt 40 ] && { t "C: 7b decode (the one-column path: unchanged)"; bj "decode_7b_C_$C" --synthetic 7b -p 512 -n 128 -r 5 --mode graph; }
[ $(left) -gt 30 ] && { t "B again"; patch -R -p1 -s < benchmarks/attempts/verify-norm-fold.patch; build; vb B_again; }
t "the runs side by side"
vb_table B C B_again
t done
} 2>&1 | tee "$OUT/s40c2_$C.log"
tar -C "$R" -czf "$OUT/s40c2_$C.tgz" .
