source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "tests/gpu, 4 workers (session38 patch + test fix + family rows)"
timeout 300 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 --dist loadfile 2>&1 | tail -8
t done
} 2>&1 | tee "$OUT/s39c2.log"
