# Sourced first by the benchmarks/verify_*_gpu.sh scripts that return a results tarball: strict
# pipes, $OUT and its results folder $R, the clock and t() (a timestamped heading), left() (the
# seconds a call has until END), the commit $C (NANOQWEN_COMMIT: the device's copy has no .git),
# the part $P (PART, default A), bj(), build(), vb() and vb_table().
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16
OUT=${OUT:-/tmp/out}; R="$OUT/r"; mkdir -p "$R"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
END=${END:-585}   # a call's budget in seconds (the device's per-call limit is 600)
left() { echo $(( END - ($(date +%s) - S) )); }
C=${NANOQWEN_COMMIT:-unknown}
P=${PART:-A}
# bj NAME ARGS...: `nanoqwen bench ARGS --json` into $R/NAME.json, then its rows' figures on one
# line (mode, test, TTFT or ms/token; the prefill weights first where the JSON has them). An
# environment assignment before it (NANOQWEN_ATTN_TMA=1 bj ...) reaches the bench.
bj() {
  local f="$R/$1.json"; shift
  timeout 200 nanoqwen bench "$@" --json > "$f" && python3 -c "import json, sys
d = json.load(open(sys.argv[1]))
print(*([d['prefill_weights']] if d.get('prefill_weights') else []),
      [(r.get('mode'), r['test'], r.get('ttft_ms') or r.get('ms_per_token')) for r in d['rows']])" "$f"
}
# build: rebuild and load the extension after a patch (device_setup.sh made the first build);
# prints the library's path
build() { timeout 200 python3 -c "
from nanoqwen.engine.build import load_extension; print(load_extension())" 2>&1 | tail -1; }
# vb NAME: bench_verify.py at 7B (10 reps) into $R/bench_verify_7b_NAME_$C.json; its t(k) table,
# then the column GEMVs' us on one line. vb_table NAME...: the runs that wrote a JSON, side by
# side against the first (benchmarks/verify_ab.py).
vb() {
  local f="$R/bench_verify_7b_$1_$C.json"
  timeout 120 python3 benchmarks/bench_verify.py --preset 7b --reps 10 --json "$f" 2>&1 \
    | grep -vE "^(qkv|o |gate|down|lm_head|op |GEMV)" | head -20
  python3 -c "import json, sys
d = json.load(open(sys.argv[1]))
print(*[f\"{r['op']}@{r['cols']}: {r['us_graph']:.2f}\" for r in d['gemv_columns'] if r['op'] != 'lm_head'])" "$f"
}
vb_table() {
  python3 benchmarks/verify_ab.py $(for l in "$@"; do
    f="$R/bench_verify_7b_${l}_$C.json"; [ -f "$f" ] && echo "$l=$f"; done)
}
