#!/usr/bin/env bash
# Session 36 call 1 (any one-GPU kind; carry .whl). What lands first, then what measures:
# (1) attempts/stepargs-norm-parts.patch applied, the build, tests/gpu on that tree (4 xdist
#     workers, then serially if that fails): the tree with verify_sample (the verify rows drawn on
#     the device; issue 13 item 3) and the StepArgs cleanup;
# (2) bench_verify 7B --sampled: a verify step's host wall with its rows drawn on the device,
#     on the host (the path before), greedy;
# (3) bench_spec on the bundled model, CUDA, --temp 0.8: the device rows (B) and the host rows (A:
#     CudaBackend.samples_rows = False, the loop's path before), alternating;
# (4) bench_app on the bundled model with the app's sampler, speculation on and off (the screen);
#     issue 12's table on all six presets (graph, context 512) if the card is an H200;
# (5) as far as time allows: attention's split sizing at 0.5B shapes, the GEMV family lab.
source benchmarks/device_prelude.sh
END=${END:-585}
left() { echo $(( END - ($(date +%s) - S) )); }
{
patch -p1 -s < benchmarks/attempts/stepargs-norm-parts.patch && echo "stepargs patch applied"
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "tests/gpu, 4 workers"
if ! timeout 240 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 \
     --dist loadfile 2>&1 | tail -15; then
  t "tests/gpu serially (the 4-worker run failed or timed out), $(left) s left"
  timeout $(( $(left) - 150 )) python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider 2>&1 | tail -25
fi
t "bench_verify 7b --sampled"
timeout 150 python3 benchmarks/bench_verify.py --preset 7b --reps 10 --sampled \
  --json "$R/bench_verify_7b_sampled_$C.json" 2>&1 | grep -vE "^(qkv|o |gate|down|lm_head|op |GEMV)" | head -30
spec() {  # spec NAME SAMPLES_ROWS
  timeout 120 python3 -c "import runpy, sys
from nanoqwen.engine.backends.cuda import CudaBackend
CudaBackend.samples_rows = bool(int(sys.argv[1]))
sys.argv = ['bench_spec.py', '--backend', 'cuda', '--temp', '0.8', '-n', '200', '--reps', '3',
            '--json', sys.argv[2]]
runpy.run_path('benchmarks/bench_spec.py', run_name='__main__')" "$2" "$R/bench_spec_t08_$1_$C.json" 2>&1 | tail -4
}
for r in 1 2; do
  t "bench_spec --temp 0.8, device rows ($r)"; spec device_$r 1
  t "bench_spec --temp 0.8, host rows ($r)"; spec host_$r 0
done
for sp in ngram off; do
  [ $(left) -gt 100 ] || break
  t "bench_app, bundled model, CUDA graph, --sampled, spec $sp"
  timeout 100 python3 benchmarks/bench_app.py --backend cuda --mode graph --sampled --spec $sp \
    --reps 3 --tokens 256 --quiet --json "$R/app_tiny_graph_sampled_spec-${sp}_$C.json" 2>&1 | tail -8
done
# issue 12's table is an H200 figure (the H100's is session 34's): on an H200 only
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && for m in 0.5b 1.5b 3b 7b 14b 32b; do
  [ $(left) -gt 40 ] || break
  t "bench $m"
  bj "bench_${m}_p512_n128_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph
done
if [ $(left) -gt 60 ]; then
  t "bench_attention, 0.5B shapes"
  timeout $(( $(left) - 5 )) python3 benchmarks/bench_attention.py --heads 14 --kv-heads 2 --head-dim 64 --layers 24 \
    --contexts 512,2048 --sweep 66:1:1,66:2:1,66:4:1,66:8:1,66:16:1,66:32:1 \
    --json "$R/attn_0.5b_pps.json" 2>&1 | tail -16
fi
if [ $(left) -gt 60 ]; then
  t "lab/gemv_int4_family.py"
  timeout $(( $(left) - 5 )) python3 benchmarks/lab/gemv_int4_family.py --json "$R/gemv_int4_family.json" 2>&1 | tail -30
fi
t "done"
} 2>&1 | tee "$OUT/call1_$C.log"
tar -C "$R" -czf "$OUT/call1_$C.tgz" .
