#!/usr/bin/env bash
# Issue 13 item 3 on the GPU: the verify step's attention with two queries a block
# (attempts/verify-attn-pairs.patch) against this tree's one query a block, on one machine, and
# all of tests/gpu on the pairs. Order by what a short budget most needs: the pairs' 7B t(k)
# first, then tests/gpu on them, then this tree rebuilt and its 7B t(k); --kernels at T = 8 with
# PDL off for both when KERNELS=1. JSONs under $OUT/r, the log in $OUT.
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD> [PRESETS="7b 3b"] [KERNELS=0] \
#     bash benchmarks/verify_attn_pairs_gpu.sh                                  (carry .whl)
source benchmarks/device_prelude.sh
PRESETS=${PRESETS:-7b 3b}
PAIRS=benchmarks/attempts/verify-attn-pairs.patch
bench() {   # variant name
  for m in $PRESETS; do
    t "$1: bench_verify $m"
    timeout 100 python3 benchmarks/bench_verify.py --preset $m --reps 10 --json "$R/verify_${m}_$1.json" \
      2>&1 | grep -E "decode step|^ ?[1-8] " | head -9
  done
  if [ "${KERNELS:-0}" = 1 ]; then
    t "$1: bench_verify --kernels 7b (NANOQWEN_PDL=0)"
    NANOQWEN_PDL=0 timeout 150 python3 benchmarks/bench_verify.py --preset 7b --reps 10 --kernels \
      --json "$R/verify_kernels_7b_$1.json" 2>&1 | grep -E "attn_decode|^sum"
  fi
}
{
patch -p1 -s < "$PAIRS" || { echo "$PAIRS does not apply"; exit 1; }
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
bench pairs
t "tests/gpu (pairs)"
timeout 300 python3 -m pytest tests/gpu -q --tb=line -p no:cacheprovider 2>&1 | tail -12
t "this tree (one query a block)"
patch -R -p1 -s < "$PAIRS" && timeout 200 python3 -c \
  "from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1
bench one
t "done"
} 2>&1 | tee "$OUT/verify_attn_pairs_$C.log"
