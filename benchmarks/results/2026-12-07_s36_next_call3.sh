#!/usr/bin/env bash
# Ready for session 37, third (carry .whl; any one-GPU kind): attempts/verify-one-call.patch
# (speculation's verify step in one engine call, one GIL release: the suspended turn ended and the
# new page table entries sent inside verify_sample, greedy rows through the greedy sampler) against
# the product: its tests, then the app and the engine with speculation, A (product) B (patch) A B.
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
patch -p1 -s < $P && build
t "the patch's tests"
timeout 200 python3 -m pytest tests/gpu/test_verify.py tests/gpu/test_cuda_backend.py -q --tb=short \
  -p no:cacheprovider -n 4 --dist loadfile 2>&1 | tail -5
t "B (one call) 1"; ab one-call_1
patch -R -p1 -s < $P && build
t "A (product) 2"; ab product_2
patch -p1 -s < $P && build
t "B (one call) 2"; ab one-call_2
if [ $(left) -gt 200 ]; then
  t "tests/gpu with the patch, 4 workers"
  timeout $(( $(left) - 5 )) python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 \
    --dist loadfile 2>&1 | tail -8
fi
t "done"
} 2>&1 | tee "$OUT/next3_$C.log"
tar -C "$R" -czf "$OUT/next3_$C.tgz" .
