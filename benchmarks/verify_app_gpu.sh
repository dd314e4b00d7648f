#!/usr/bin/env bash
# One device call for issue 10's product figures: install (textual wheels from .whl), build,
# all of tests/gpu, `nanoqwen bench` (7B synthetic), TTFT at new prompt lengths
# (benchmarks/bench_prefill_lengths.py), then a real 7B-shaped .nanoqwen file
# (random weights, the real Qwen2 tokenizer from .tok/tokenizer.json) and benchmarks/bench_app.py
# in graph and eager mode (SAMPLED=1: graph mode once more with the app's default sampler,
# bench_app --sampled). Logs and JSON under $OUT.
# usage (from the checkout, carry .whl and .tok), the commit named here, where it is known:
#   NANOQWEN_COMMIT=<git rev-parse --short HEAD, run on this side> bash benchmarks/verify_app_gpu.sh
# (on the device, `git rev-parse` gives the commit its copy was first synced at)
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16 NANOQWEN_COMMIT
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
{
. benchmarks/device_setup.sh
[ "${SKIP_TESTS:-0}" = 1 ] || { t "tests/gpu"; timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -30; }
t "bench 7b"
timeout 100 nanoqwen bench --synthetic 7b -p 512 -n 128 -r 5 --mode graph,eager --json > "$OUT/bench_7b.json" && tail -c 300 "$OUT/bench_7b.json"
t "prefill at new lengths"
OUT=$OUT timeout 120 python3 benchmarks/bench_prefill_lengths.py 2>&1 | tail -23
t "convert 7b"
timeout 200 nanoqwen convert --synthetic 7b --tokenizer .tok/tokenizer.json -o /tmp/7b.nanoqwen 2>&1 | tail -2
for m in graph eager; do
t "bench_app $m"
timeout ${APP_TIMEOUT:-150} python3 benchmarks/bench_app.py --model /tmp/7b.nanoqwen --backend cuda --mode $m \
  --tokens ${TOKENS:-1024} --reps ${REPS:-3} --quiet --json "$OUT/app_7b_$m.json" 2>&1 | tail -12
done
if [ "${SAMPLED:-0}" = 1 ]; then  # the app's default sampler (bench_app --sampled), graph mode
t "bench_app graph, sampled"
timeout ${APP_TIMEOUT:-150} python3 benchmarks/bench_app.py --model /tmp/7b.nanoqwen --backend cuda --mode graph \
  --tokens ${TOKENS:-1024} --reps ${REPS:-3} --quiet --sampled --json "$OUT/app_7b_graph_sampled.json" 2>&1 | tail -12
fi
t "done"
} 2>&1 | tee "$OUT/verify_app_log.txt"
true
