#!/usr/bin/env bash
# session 34 call 2 (the warm machine of call 1, or a fresh one): where the fold's time goes --
# bench_step on the 0.5B and 7B presets with the fold on and off (each op alone in a graph of
# launches, and the whole step); then session 33's call 4 (bench_app, bundled model, CUDA graph,
# the app's speculation setting off then ngram), between them bench_verify at 7B with the fold
# on and off (t(k) / decode). Carry .whl.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "test_norm_fold.py (the fixed message test)"; timeout 100 python3 -m pytest tests/gpu/test_norm_fold.py -q --tb=short -p no:cacheprovider 2>&1 | tail -3
for m in 0.5b 7b; do
  for f in 1 0; do
    t "bench_step $m fold $f"
    NANOQWEN_NORM_FOLD=$f timeout 120 python3 benchmarks/bench_step.py --preset $m 2>&1 | sed -n '1,20p'
  done
done
for f in 1 0; do   # issue 13 item 3: t(k) against the decode step, which the fold makes faster
  t "bench_verify 7b fold $f"
  NANOQWEN_NORM_FOLD=$f timeout 150 python3 benchmarks/bench_verify.py --preset 7b --reps 10 \
    --json "$R/bench_verify_7b_fold$f.json" 2>&1 | grep -E "decode step|^ ?[1-8] |^16 " | head -10
done
for sp in off ngram; do
  t "bench_app, graph, speculation $sp"
  timeout 150 python3 benchmarks/bench_app.py --backend cuda --mode graph --spec $sp --reps 3 \
    --tokens 256 --max-other-load 4 --quiet --json "$R/app_tiny_graph_spec-$sp.json" 2>&1 | tail -9
done
t "done"
} 2>&1 | tee "$OUT/s34c2_$C.log"
tar -C "$R" -czf "$OUT/s34c2_$C.tgz" . && rm -rf "$R"
