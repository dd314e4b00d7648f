# session 31 call 3: all of tests/gpu on the submitted tree
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "tests/gpu"
timeout 500 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -x 2>&1 | tail -25
t "done"
} 2>&1 | tee "$OUT/call3_tests.log"
