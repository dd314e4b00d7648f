#!/usr/bin/env bash
# A kernel change and its baseline on the same device machine, in one call: install, build,
# STEPS on the tree with the change (B); then `patch -R` of AB_PATCH (the change as a diff
# against the baseline), rebuild, and the same STEPS again (A). With AB_APPLY=1 the tree is the
# baseline and AB_PATCH is applied first (a patch of benchmarks/attempts/); without it the tree
# already holds the change. Logs and JSON under $OUT, each
# file's name ending in _B_<label> / _A_<label>. Device sessions differ by several percent for
# the same kernels (RESULTS.md, sessions 12 and 14), so a change is judged against its A on the
# same machine, never against another session's figure.
#   AB_APPLY=1 AB_PATCH=benchmarks/attempts/lm-head-tc.patch NANOQWEN_COMMIT=<sha> \
#     STEPS="tests verify bench" bash benchmarks/verify_ab_gpu.sh          (carry .whl)
# STEPS: tests (tests/gpu/test_gemv.py + test_verify.py, B only), lab (lab/lm_head_tc.py, B
# only), verify (bench_verify.py 7b, with the acceptance of ACCEPT if set), bench (nanoqwen
# bench 7b, graph and eager).
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
C=${NANOQWEN_COMMIT:-unknown}
STEPS=${STEPS:-tests verify bench}
has() { [[ " $STEPS " == *" $1 "* ]]; }
measure() {  # $1: B or A
  local L="$1_$C"
  if has verify; then
    t "bench_verify 7b ($1)"
    (cd benchmarks && timeout 150 python3 bench_verify.py --preset 7b ${ACCEPT:+--acceptance "$ACCEPT"} \
      --json "$OUT/bench_verify_7b_$L.json" 2>&1 | tail -32)
  fi
  if has bench; then
    t "bench 7b ($1)"
    timeout 100 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph,eager --json \
      > "$OUT/bench_7b_$L.json" && python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['rows']:
    print(r['mode'], r['test'], round(r.get('ms_per_token', r.get('ttft_ms')), 3))" "$OUT/bench_7b_$L.json"
  fi
}
{
if [ "${AB_APPLY:-0}" = 1 ]; then t "patch $AB_PATCH"; patch -p1 < "$AB_PATCH" | tail -3; fi
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name --format=csv,noheader
if has tests; then
  t "tests (B)"; timeout 200 python3 -m pytest tests/gpu/test_gemv.py tests/gpu/test_verify.py -q -x --tb=short -p no:cacheprovider 2>&1 | tail -15
fi
if has lab; then
  t "lab lm_head (B)"; timeout 200 python3 benchmarks/lab/lm_head_tc.py --json "$OUT/lab_lm_head_tc_B_$C.json" 2>&1 | grep -v "ptxas\|Compiling\|stack frame" | cut -c1-220
fi
measure B
if [ -n "${AB_PATCH:-}" ]; then
  t "patch -R $AB_PATCH"; patch -R -p1 < "$AB_PATCH" | tail -3
  t "rebuild (A)"; timeout 200 python3 -c "from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -3
  measure A
fi
t "done"
} 2>&1 | tee "$OUT/ab_$C.log"
