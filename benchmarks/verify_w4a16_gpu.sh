#!/usr/bin/env bash
# Issue 14 item 1 on the GPU: the prefill through gemm_int4 (prefill_weights="int4") against
# the resident fp16 copy and the per-layer dequantization, in two device calls (each under the
# 10-minute limit; the second finds the first's build when it comes while the machine is warm).
#   PART=A: install, build, tests/gpu (all of it, test_gemm_int4.py among them), then
#           `nanoqwen bench --prefill-weights` resident|dequant|int4 at 7B: TTFT of 512 and 2048
#           prompt tokens, and of a 40-token next turn after 1024 cached (-d 1024 -p 40)
#   PART=B: the 32B, 1.5B and 0.5B TTFT 512 with int4 against dequant, the 7B decode bench
#           (must not move), then the labs: lab/w4a16_gemm.py (block shapes), lab/lm_head_tc.py
#           and lab/gemv_int8x.py (issue 12 item 4)
# Logs and JSON under $OUT (carry .whl: the app tests' wheels).
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD> PART=A bash benchmarks/verify_w4a16_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
C=${NANOQWEN_COMMIT:-unknown}
pf() {  # pf PRESET WEIGHTS ARGS...: one bench run's JSON, its table on stdout
  local p=$1 w=$2; shift 2
  local f="$OUT/bench_${p}_pf_${w}_$(echo "$*" | tr -d ' -')_$C.json"
  t "bench $p --prefill-weights $w $*"
  timeout 150 nanoqwen bench --synthetic "$p" --prefill-weights "$w" --mode graph "$@" --json > "$f" \
    && python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['prefill_weights'], [(r['test'], r.get('ttft_ms') or r.get('ms_per_token')) for r in d['rows']])" "$f"
}
{
source benchmarks/device_setup.sh
if [ "${PART:-A}" = A ]; then
  t "tests/gpu"; timeout ${TEST_TIMEOUT:-280} python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -30
  for w in int4 dequant resident; do
    for a in "-p 512" "-p 2048" "-d 1024 -p 40"; do pf 7b $w $a -n 8 -r 5; done
  done
else
  for p in 32b 1.5b 0.5b; do for w in int4 dequant; do pf $p $w -p 512 -n 8 -r 5; done; done
  t "bench 7b decode"; timeout 100 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph,eager --json > "$OUT/bench_7b_$C.json" && tail -c 600 "$OUT/bench_7b_$C.json"; echo
  t "lab w4a16_gemm"; timeout 200 python3 benchmarks/lab/w4a16_gemm.py --json "$OUT/lab_w4a16_gemm_$C.json" 2>&1 | tail -45
  t "lab lm_head_tc"; timeout 100 python3 benchmarks/lab/lm_head_tc.py --json "$OUT/lab_lm_head_tc_$C.json" 2>&1 | tail -14
  t "lab gemv_int8x"; timeout 120 python3 benchmarks/lab/gemv_int8x.py --json "$OUT/lab_gemv_int8x_$C.json" 2>&1 | tail -10
fi
t "done"
} 2>&1 | tee "$OUT/verify_w4a16_${PART:-A}_$C.log"
