#!/usr/bin/env bash
# Ready for session 38 (carry .whl; any one-GPU kind): attempts/device-spec.patch (session 37,
# written without a device: compiles for sm_90a, bindings syntax-checked, the CPU suite passes
# with it) -- prompt lookup drafted, verified, sampled and accepted on the device inside the
# engine's decode loop (csrc/spec.cu; one graph replay a step: the halt gate, spec_draft, a
# switch node over the decode step and the verify bodies of T = 2..16). Its first run: the
# build, the tests that decide it (its own file first, -x, so a failure is short), then the
# A/B within one build through NANOQWEN_SPEC_DEVICE (device against the host loop against
# plain), the app's screen rate with speculation, the 7B's cost of a speculative turn that
# never drafts (random weights), then tests/gpu.
source benchmarks/device_prelude.sh
{
patch -p1 -s < benchmarks/attempts/device-spec.patch || { echo "the patch does not apply"; exit 1; }
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "the patch's own tests (-x)"
timeout 150 python3 -m pytest tests/gpu/test_spec_device.py -x -q --tb=short -p no:cacheprovider \
  2>&1 | tail -40
t "the tests beside it"
timeout 150 python3 -m pytest tests/gpu/test_verify.py tests/gpu/test_cuda_backend.py -q --tb=line \
  -p no:cacheprovider -n 4 --dist loadfile 2>&1 | tail -12
t "bench_spec_device, the bundled model (plain / device / host loop, graph and eager)"
timeout 150 python3 benchmarks/bench_spec_device.py --reps 3 -n 200 \
  --json "$R/bench_spec_device_tiny_$C.json" 2>&1 | tail -9
t "the app with prompt lookup: on the device, the host loop, off"
for v in 1 0; do
  NANOQWEN_SPEC_DEVICE=$v timeout 90 python3 benchmarks/bench_app.py --backend cuda --mode graph \
    --spec ngram --reps 3 --tokens 256 --quiet \
    --json "$R/app_tiny_graph_spec-ngram_device${v}_$C.json" 2>&1 | sed -n 1,6p
done
timeout 90 python3 benchmarks/bench_app.py --backend cuda --mode graph --spec off --reps 3 \
  --tokens 256 --quiet --json "$R/app_tiny_graph_spec-off_$C.json" 2>&1 | sed -n 1,6p
t "bench_spec_device --synthetic 7b (a speculative turn that never drafts)"
timeout 120 python3 benchmarks/bench_spec_device.py --synthetic 7b --reps 3 -n 128 \
  --json "$R/bench_spec_device_7b_$C.json" 2>&1 | tail -7
if [ $(left) -gt 190 ]; then
  t "tests/gpu with the patch, 4 workers"
  timeout $(( $(left) - 5 )) python3 -m pytest tests/gpu -q --tb=line -p no:cacheprovider -n 4 \
    --dist loadfile 2>&1 | tail -10
fi
t "done"
} 2>&1 | tee "$OUT/next_$C.log"
tar -C "$R" -czf "$OUT/next_$C.tgz" .
