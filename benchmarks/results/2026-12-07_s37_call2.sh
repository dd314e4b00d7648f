#!/usr/bin/env bash
# Session 37, call 2 (carry .whl; any one-GPU kind): session 36's next_call3 reordered so that
# tests/gpu runs on the patched tree before the second A/B round (the first A/B decides; the
# second only if time is left): attempts/verify-one-call.patch (speculation's verify step in one
# engine call, one GIL release) against the product (HEAD, with whatever call 1 landed).
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
P=benchmarks/attempts/verify-one-call.patch
ab() {  # ab NAME: the engine's and the app's speculation figures of this tree
  timeout 60 python3 benchmarks/bench_spec.py --backend cuda -n 200 --reps 3 \
    --json "$R/bench_spec_greedy_$1_$C.json" 2>&1 | tail -2
  timeout 60 python3 benchmarks/bench_spec.py --backend cuda --temp 0.8 -n 200 --reps 3 \
    --json "$R/bench_spec_t08_$1_$C.json" 2>&1 | tail -2
  timeout 90 python3 benchmarks/bench_app.py --backend cuda --mode graph --spec ngram --reps 3 \
    --tokens 256 --quiet --json "$R/app_tiny_graph_spec-ngram_$1_$C.json" 2>&1 | sed -n 1,6p
}
t "A (product) 1"; ab product_1
t "the app with speculation off (the ratio's denominator, this machine)"
timeout 90 python3 benchmarks/bench_app.py --backend cuda --mode graph --spec off --reps 3 \
  --tokens 256 --quiet --json "$R/app_tiny_graph_spec-off_$C.json" 2>&1 | sed -n 1,6p
patch -p1 -s < $P && build
t "B (one call) 1"; ab one-call_1
t "tests/gpu with the patch, 4 workers"
timeout $(( $(left) - 5 )) python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 \
  --dist loadfile 2>&1 | tail -8
if [ $(left) -gt 200 ]; then
  patch -R -p1 -s < $P && build
  t "A (product) 2"; ab product_2
  patch -p1 -s < $P && build
  t "B (one call) 2"; ab one-call_2
fi
t "done"
} 2>&1 | tee "$OUT/call2_$C.log"
tar -C "$R" -czf "$OUT/call2_$C.tgz" .
