#!/usr/bin/env bash
# Session 38, call 2 (carry .whl; any one-GPU kind). The device budget is short (starts were
# refused for most of the session), so tests/gpu comes first, on exactly the tree as committed;
# then t(k) at 7B and the speculative turn's cost (min_pps 8 and the gate in spec_draft landed);
# then the product's presets (A) and attempts/gemv-family-rows.patch (B) with its GEMV tests,
# measured only (landing it would need tests/gpu on it); then min_pps 16 against 8 if time is left.
source benchmarks/device_prelude.sh
{
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t "tests/gpu, 4 workers (the tree as committed)"
timeout 240 python3 -m pytest tests/gpu -q --tb=short -p no:cacheprovider -n 4 \
  --dist loadfile 2>&1 | tail -8
t "bench_verify 7b (t(k) at min_pps 8)"
timeout 100 python3 benchmarks/bench_verify.py --preset 7b --reps 10 \
  --json "$R/bench_verify_7b_$C.json" 2>&1 | grep -vE "^(qkv|o |gate|down|lm_head|op |GEMV)" | head -24
t "bench_spec_device 7b"
timeout 60 python3 benchmarks/bench_spec_device.py --synthetic 7b --reps 3 -n 128 \
  --json "$R/bench_spec_device_7b_$C.json" 2>&1 | tail -7
P="0.5b 1.5b 3b 7b 14b 32b"
for m in $P; do [ $(left) -gt 150 ] || break; t "bench $m (A: the product)"
  bj "rows_${m}_A_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
if [ $(left) -gt 130 ]; then
  patch -p1 -s < benchmarks/attempts/gemv-family-rows.patch && build
  for m in 3b 14b 32b 0.5b 1.5b; do [ $(left) -gt 40 ] || break; t "bench $m (B: + the rows)"
    bj "rows_${m}_B_$C" --synthetic $m -p 512 -n 128 -r 5 --mode graph; done
  if [ $(left) -gt 40 ]; then t "GEMV tests with the rows"
    timeout $(( $(left) - 10 )) python3 -m pytest tests/gpu/test_gemv.py -q --tb=short \
      -p no:cacheprovider -n 4 2>&1 | tail -3; fi
fi
t "done"
} 2>&1 | tee "$OUT/s38c2_$C.log"
tar -C "$R" -czf "$OUT/s38c2_$C.tgz" .
