#!/usr/bin/env bash
# Issue 14 item 1 on the GPU: the prefill's INT4 GEMM (csrc/gemm_int4.cu) against the resident
# fp16 copy and the per-layer dequantization.
#   PART=A: install, build, tests/gpu (all of it), the product GEMM per projection and m
#           (bench_gemm_int4.py), then `nanoqwen bench` at 7B: a 40-token next turn after 1024
#           cached (-d 1024 -p 40) with each prefill's weights, dequant also with
#           NANOQWEN_INT4_MAX_M=0 (cuBLAS for the turn: the old prefill), TTFT 512 with each,
#           2048 with int4, and the decode bench (graph, eager), which must not move
#   PART=B: the 32B, 1.5B and 0.5B TTFT 512 with int4 against dequant, then the labs:
#           lab/gemm_int4_shapes.py, lab/lm_head_tc.py and lab/gemv_int8x.py (issue 12 item 4)
# The JSON files go to $OUT/r and come back as one $OUT/results_<PART>_<commit>.tgz (the device
# returns at most 8 files); the log beside it. Carry .whl (the app tests' wheels).
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD> PART=A bash benchmarks/verify_w4a16_gpu.sh
source benchmarks/device_prelude.sh
pf() {  # pf TAG PRESET WEIGHTS ARGS...: one bench run's JSON and its figures
  local tag=$1 p=$2 w=$3; shift 3
  t "bench $p --prefill-weights $w $* ($tag)"
  bj "bench_${p}_pf_${w}${tag}_$(echo "$*" | tr -d ' -')_$C" --synthetic "$p" --prefill-weights "$w" \
    --mode graph "$@"
}
{
source benchmarks/device_setup.sh
if [ "$P" = A ]; then
  t "tests/gpu"; timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -30
  t "bench_gemm_int4 7b"; timeout 120 python3 benchmarks/bench_gemm_int4.py --json "$R/bench_gemm_int4_7b_$C.json" 2>&1 | tail -50
  for w in resident dequant int4; do pf "" 7b $w -d 1024 -p 40 -n 8 -r 5; done
  NANOQWEN_INT4_MAX_M=0 pf _maxm0 7b dequant -d 1024 -p 40 -n 8 -r 5
  for w in resident dequant int4; do pf "" 7b $w -p 512 -n 8 -r 5; done
  pf "" 7b int4 -p 2048 -n 8 -r 3
  t "bench 7b decode"; bj "bench_7b_$C" --synthetic 7b -p 512 -n 128 -r 5 --mode graph,eager
else
  for p in 32b 1.5b 0.5b; do for w in int4 dequant; do pf "" $p $w -p 512 -n 8 -r 5; done; done
  t "lab gemm_int4_shapes"; timeout 300 python3 benchmarks/lab/gemm_int4_shapes.py --json "$R/lab_gemm_int4_shapes_$C.json" 2>&1 | grep -v "^proj"
  t "lab lm_head_tc"; timeout 100 python3 benchmarks/lab/lm_head_tc.py --json "$R/lab_lm_head_tc_$C.json" 2>&1 | tail -14
  t "lab gemv_int8x"; timeout 120 python3 benchmarks/lab/gemv_int8x.py --json "$R/lab_gemv_int8x_$C.json" 2>&1 | tail -10
fi
t "done"
} 2>&1 | tee "$OUT/verify_w4a16_${P}_$C.log"
tar czf "$OUT/results_${P}_$C.tgz" -C "$R" . && rm -rf "$R"
