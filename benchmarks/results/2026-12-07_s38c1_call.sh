#!/usr/bin/env bash
# Session 38, call 1 (carry .whl; any one-GPU kind). In order of what the session needs first:
#  1. issue 12's table on this machine (every preset, HEAD; on an H200 the issue's own table);
#  2. the app with prompt lookup inside the engine's loop vs off, greedy and with the app's
#     sampler (the evidence for CudaBackend.spec_auto = "ngram": "auto" turns it on on the GPU);
#  3. attention's split sizing per preset (session 36's call2: NANOQWEN_ATTN_MIN_PPS 2/4/8 at
#     depth 0 and 2048 on 0.5B, 1.5B, 3B, 7B; kernel sweeps at the 7B's and 1.5B's shapes);
#  4. the speculative graph without its gate kernel and IF node (a1abd21; the tree's) against
#     with them (results/2026-12-07_s38_spec-gate.patch reversed): bench_spec_device, 7B and bundled;
#  5. attempts/gemv-family-rows.patch: B, its GEMV tests, then A again if time is left.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader
presets() { for m in 0.5b 1.5b 3b 7b 14b 32b; do t "bench $m ($1)"
  bj "bench_${m}_$1_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done; }
presets A1
for s in off ngram; do for smp in "" --sampled; do
  t "app, bundled model, graph, spec $s ${smp:-greedy}"
  timeout 90 python3 benchmarks/bench_app.py --backend cuda --mode graph --spec $s $smp --reps 3 \
    --tokens 256 --quiet --json "$R/app_tiny_graph_spec-${s}_${smp:-greedy}_$C.json" 2>&1 | sed -n 1,8p
done; done
t "bench_attention, 7B shapes"
timeout 90 python3 benchmarks/bench_attention.py --contexts 512,2048,8192 \
  --sweep 33:1:1,33:2:1,33:4:1,33:8:1,33:16:1 --json "$R/attn_7b_pps_$C.json" 2>&1 | tail -18
t "bench_attention, 1.5B shapes"
timeout 90 python3 benchmarks/bench_attention.py --heads 12 --kv-heads 2 --head-dim 128 --layers 28 \
  --contexts 512,2048,8192 --sweep 66:1:1,66:2:1,66:4:1,66:8:1,66:16:1 \
  --json "$R/attn_1.5b_pps_$C.json" 2>&1 | tail -18
for m in 0.5b 1.5b 3b 7b; do for d in 0 2048; do for p in 2 4 8; do
  t "$m min_pps $p depth $d"
  NANOQWEN_ATTN_MIN_PPS=$p bj "pps_${m}_${p}_d${d}_$C" --synthetic $m -p 512 -n 128 -r 5 -d $d --mode graph
done; done; done
sd() {  # the speculative graph's cost where nothing drafts (7B) and its gain where drafts come
  t "bench_spec_device 7b ($1)"
  timeout 90 python3 benchmarks/bench_spec_device.py --synthetic 7b --reps 3 -n 128 \
    --json "$R/bench_spec_device_7b_$1_$C.json" 2>&1 | tail -7
  t "bench_spec_device, bundled model ($1)"
  timeout 90 python3 benchmarks/bench_spec_device.py --reps 3 -n 200 \
    --json "$R/bench_spec_device_tiny_$1_$C.json" 2>&1 | tail -9
}
sd gate-in-draft
patch -R -p1 -s < benchmarks/results/2026-12-07_s38_spec-gate.patch && build
sd gate-if
if [ $(left) -gt 150 ]; then
  patch -p1 -s < benchmarks/attempts/gemv-family-rows.patch && build
  presets B1
  t "GEMV tests with the rows"
  timeout $(( $(left) - 100 )) python3 -m pytest tests/gpu/test_gemv.py -q --tb=short -p no:cacheprovider \
    -n 4 2>&1 | tail -4
  if [ $(left) -gt 95 ]; then
    patch -R -p1 -s < benchmarks/attempts/gemv-family-rows.patch && build
    for m in 3b 14b 32b; do t "bench $m (A2)"; bj "bench_${m}_A2_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
  fi
fi
t "done"
} 2>&1 | tee "$OUT/s38c1_$C.log"
tar -C "$R" -czf "$OUT/s38c1_$C.tgz" .
