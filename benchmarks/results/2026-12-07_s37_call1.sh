#!/usr/bin/env bash
# Session 37, call 1 (carry .whl; any one-GPU kind): the two ready patches in one call, since
# machine starts cost 90 s each and came rarely today: A = HEAD; B = HEAD +
# attempts/gemv-family-rows.patch + attempts/verify-one-call.patch (independent files: GEMV rows
# by k for the non-7B presets; speculation's verify step in one engine call). A B on the presets
# the rows change most (3B, 14B, 32B; the 0.5B/1.5B predictions, -8 us, are below the noise) and
# on speculation (engine and app), then tests/gpu on B, then A B again if time is left.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ab() {  # ab NAME: the presets' decode and the speculation figures of this tree
  for m in 3b 14b 32b; do t "bench $m ($1)"; bj "bench_${m}_$1_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
  t "speculation ($1), the host loop (verify-one-call's path since the device loop landed)"
  export NANOQWEN_SPEC_DEVICE=0
  timeout 60 python3 benchmarks/bench_spec.py --backend cuda -n 200 --reps 3 \
    --json "$R/bench_spec_greedy_$1_$C.json" 2>&1 | tail -2
  timeout 60 python3 benchmarks/bench_spec.py --backend cuda --temp 0.8 -n 200 --reps 3 \
    --json "$R/bench_spec_t08_$1_$C.json" 2>&1 | tail -2
  timeout 90 python3 benchmarks/bench_app.py --backend cuda --mode graph --spec ngram --reps 3 \
    --tokens 256 --quiet --json "$R/app_tiny_graph_spec-ngram_$1_$C.json" 2>&1 | sed -n 1,6p
  unset NANOQWEN_SPEC_DEVICE
}
both() { patch $1 -p1 -s < benchmarks/attempts/gemv-family-rows.patch &&
         patch $1 -p1 -s < benchmarks/attempts/verify-one-call.patch && build; }
t "A (HEAD) 1"; ab head_1
t "the app with speculation off (the ratio's denominator, this machine)"
timeout 90 python3 benchmarks/bench_app.py --backend cuda --mode graph --spec off --reps 3 \
  --tokens 256 --quiet --json "$R/app_tiny_graph_spec-off_$C.json" 2>&1 | sed -n 1,6p
both ""
t "B (rows + one call) 1"; ab both_1
t "tests/gpu on B, 4 workers"
timeout $(( $(left) - 5 )) python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 \
  --dist loadfile 2>&1 | tail -8
if [ $(left) -gt 330 ]; then
  both -R; t "A (HEAD) 2"; ab head_2
  both ""; t "B 2"; ab both_2
fi
t "done"
} 2>&1 | tee "$OUT/call1_$C.log"
tar -C "$R" -czf "$OUT/call1_$C.tgz" .
