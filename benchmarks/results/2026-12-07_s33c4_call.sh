#!/usr/bin/env bash
# session 33 call 4: what the person sees with speculation -- bench_app on the bundled model, CUDA
# graph, the app's speculation setting off then ngram (the second turn rewrites the first reply),
# 3 measured reps each. Carry .whl and .tok is not needed (the bundled model has its tokenizer).
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for sp in off ngram; do
  t "bench_app, graph, speculation $sp"
  timeout 150 python3 benchmarks/bench_app.py --backend cuda --mode graph --spec $sp --reps 3 \
    --tokens 256 --max-other-load 4 --quiet --json "$R/app_tiny_graph_spec-$sp.json" 2>&1 | tail -9
done
t "done"
} 2>&1 | tee "$OUT/call4_$C.log"
