#!/usr/bin/env bash
# One device call: the app's Enter -> first text, this tree against an earlier commit's app/
# on the same machine in the same session (run-to-run spread between sessions is several ms).
# Installs and builds (device_setup.sh), converts a 7B-shaped file (random weights, the real
# tokenizer from .tok/), runs benchmarks/lab/app_timeline.py (bench_app with the timeline of
# each first text) in graph and eager mode on this tree, then with app/ as it was at $BASE
# (engine and benchmarks unchanged) in graph mode, then puts app/ back. Logs and JSON in $OUT.
# TESTS=1 runs tests/gpu first; BENCH=1 then `nanoqwen bench` at 7B (graph, eager);
# VARIANT="benchmarks/lab/<script>.py ..." runs each lab variant of app_timeline.py in the
# modes of VARIANT_MODES (default "graph eager") after this tree's runs; REPS (3), TOKENS
# (1024). usage (carry .whl and .tok):
#   NANOQWEN_COMMIT=<this tree's commit> BASE=<rev> bash benchmarks/verify_app_ab_gpu.sh
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 NANOQWEN_COMMIT
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
app_run() {  # mode, json name[, script]
  timeout ${APP_TIMEOUT:-150} python3 ${3:-benchmarks/lab/app_timeline.py} --model /tmp/7b.nanoqwen \
    --backend cuda --mode $1 --tokens ${TOKENS:-1024} --reps ${REPS:-3} --quiet \
    --json "$OUT/$2.json" 2>&1 | tail -16
}
{
. benchmarks/device_setup.sh
[ "${TESTS:-0}" = 1 ] && { t "tests/gpu"; timeout 300 python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/tests_gpu.txt"; }
[ "${BENCH:-0}" = 1 ] && { t "bench 7b"; timeout 100 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph,eager --json > "$OUT/bench_7b.json" && tail -c 300 "$OUT/bench_7b.json"; echo; }
t "convert 7b"
timeout 200 nanoqwen convert --synthetic 7b --tokenizer .tok/tokenizer.json -o /tmp/7b.nanoqwen 2>&1 | tail -2
for m in graph eager; do t "app $m ($NANOQWEN_COMMIT)"; app_run $m app_7b_${m}_$NANOQWEN_COMMIT; done
for variant in ${VARIANT:-}; do
  v=$(basename "$variant" .py)
  for m in ${VARIANT_MODES:-graph eager}; do
    t "app $m ($v on $NANOQWEN_COMMIT)"; app_run $m app_7b_${m}_${v}_$NANOQWEN_COMMIT "$variant"
  done
done
if [ -n "${BASE:-}" ]; then
  # app/ as it was at $BASE (this tree's bench_app.py drives either)
  cp -r app /tmp/app_tree
  if git archive "$BASE" app > /tmp/base.tar; then
    rm -rf app && tar -xf /tmp/base.tar
    t "app graph (app/ at $BASE)"
    NANOQWEN_COMMIT=$BASE app_run graph app_7b_graph_$BASE
  else t "no $BASE in this copy's git"; fi
  rm -rf app && cp -r /tmp/app_tree app
fi
t "done"
} 2>&1 | tee "$OUT/verify_app_ab_log.txt"
true
